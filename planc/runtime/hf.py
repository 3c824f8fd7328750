"""Hugging Face causal LMs as planc pipeline layers (``model hf "ARCH" { ... }`` / ``model hf "dir"``).

The model is ``AutoModelForCausalLM.from_config(config, attn_implementation=attn)`` built on the meta
device, its config with every ``*dropout*`` / ``*pdrop*`` probability set to 0, initialized module by
module by the plan-independent rule (``hf_init``: a module's values depend on the plan's seed and its
name only), then, for a folder with weights, the folder's tensors (``hf_weights``: each rank reads its
slices). A rank materializes only the layers it holds (:func:`build_share`). It is cut by the config's
``base_model_pp_plan``:

- layer 0 (:class:`Embeddings`): the base model's modules listed before the decoder-layer list
  (``embed_tokens``; GPT-NeoX's ``embed_in``, ``emb_dropout``), ids [B, T] -> hidden [B, T, H];
- layers 1..L (:class:`DecoderLayer`): one HF decoder layer each, called as the base model's forward
  calls it: positions 0..T-1, ``position_embeddings`` from the base model's rotary module, the causal
  mask HF builds for the layer's attention type (``config.layer_types[i]``; without them a sliding
  window when ``config.sliding_window`` is set, else full causal attention);
- layer L + 1 (:class:`Head`): the modules after the list (``norm``) and the causal LM's own
  ``_pp_plan`` modules (``lm_head``), hidden -> logits [B, T, V] (Gemma-2's final logit soft-capping
  applied as its forward does).

So the chain computes ``model(ids).logits``. Every layer has ``planc_param_names``: local parameter
name -> the HF state-dict name (``model.layers.3.self_attn.q_proj.weight``, ``lm_head.weight``).
Tied embeddings stay HF's: the embedding and the head hold the same ``nn.Parameter`` object.

transformers is imported lazily (the compiler imports nothing of torch) and never downloads anything.
"""
from __future__ import annotations

import difflib
import os

import torch
from torch import nn

from . import hf_init, hf_vocab
from .tensor_parallel import gather_sequence_whole, scatter_sequence

__all__ = ["ATTN_IMPLEMENTATION", "attn_implementation", "HfModelError", "config_from_keys", "config_from_record", "build_model",
           "pipeline_layers", "builder", "causal_lm_loss", "causal_lm_architectures"]

# every HF model planc builds uses torch's scaled_dot_product_attention where the architecture supports it,
# else HF's eager attention (plan.json records which: train.model.hf.attn_implementation; a reference must
# use the same)
ATTN_IMPLEMENTATION = "sdpa"


def attn_implementation(arch: str) -> str:
    """The attention implementation planc builds ``arch`` with: ``sdpa`` where it supports it, else ``eager``."""
    return ATTN_IMPLEMENTATION if getattr(model_class(arch), "_supports_sdpa", False) else "eager"


class HfModelError(ValueError):
    """A plan's ``model hf`` the transformers library cannot build. ``part`` says where the compiler points:
    ``arch`` (the architecture string), ``key:NAME`` (that config key), ``folder`` or ``pp`` (the model line)."""

    def __init__(self, part: str, message: str):
        super().__init__(message)
        self.part = part


def transformers():
    """The transformers module, offline: nothing is ever downloaded."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    import transformers as tf
    tf.logging.set_verbosity_error()
    return tf


def causal_lm_architectures() -> list[str]:
    """The ``*ForCausalLM`` classes ``AutoModelForCausalLM`` knows, sorted."""
    transformers()
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as names
    flat = set()
    for v in names.values():
        flat.update(v if isinstance(v, (list, tuple)) else (v,))
    return sorted(flat)


def _suggest(word: str, choices) -> str:
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" (did you mean '{close[0]}'?)" if close else ""


def model_class(arch: str):
    """The transformers class named ``arch``, a causal LM (else an ``arch`` error with a suggestion)."""
    known = causal_lm_architectures()
    if arch not in known:
        raise HfModelError("arch", f"'{arch}' is not a causal-LM class of transformers "
                                   f"{transformers().__version__}{_suggest(arch, known)}")
    return getattr(transformers(), arch)


def _no_dropout(config) -> None:
    """Every ``*dropout*`` / ``*pdrop*`` probability of the config (and its sub-configs) set to 0."""
    for key, value in list(config.to_dict().items()):
        if ("dropout" in key or "pdrop" in key) and isinstance(value, (int, float)) and not isinstance(value, bool):
            setattr(config, key, 0.0)


def _known_keys(config_class) -> list[str]:
    import dataclasses
    keys = set(getattr(config_class, "attribute_map", {}) or {})
    if dataclasses.is_dataclass(config_class):
        keys.update(f.name for f in dataclasses.fields(config_class))
    else:
        import inspect
        keys.update(p for p in inspect.signature(config_class.__init__).parameters if p not in ("self", "kwargs"))
    keys.update(config_class().to_dict())
    return sorted(k for k in keys if not k.startswith("_"))


def _pad_inside_vocab(config, keys) -> None:
    """transformers builds the token embedding with ``pad_token_id`` as its padding index, which torch
    asserts is inside ``vocab_size``: refused here, at the key, with the fix (Phi3's default is 32000)."""
    vocab, pad = getattr(config, "vocab_size", None), getattr(config, "pad_token_id", None)
    if not isinstance(vocab, int) or not isinstance(pad, int) or isinstance(pad, bool) or -vocab <= pad < vocab:
        return
    where = next((k for k in ("pad_token_id", "vocab_size") if k in keys), "")
    raise HfModelError(f"key:{where}", f"pad_token_id = {pad} is outside vocab_size = {vocab} (token ids "
                                       f"0..{vocab - 1}), and transformers builds the embedding with it as the "
                                       f"padding index: write pad_token_id = 0 (or another id below {vocab}), "
                                       f"or vocab_size = {pad + 1} or more")


def _finish(config, arch: str, keys=()):
    _pad_inside_vocab(config, keys)
    _no_dropout(config)
    config.architectures = [arch]
    config.use_cache = False
    if not getattr(config, "base_model_pp_plan", None):
        raise HfModelError("pp", f"{arch}'s config ({type(config).__name__}) has no base_model_pp_plan, so planc "
                                 "cannot cut it into pipeline layers; write a builder function for it instead: "
                                 'model "file.py:build" (docs/models.md)')
    return config


def config_from_keys(arch: str, keys: dict):
    """``arch``'s config class with the plan's ``keys`` (every one checked against the class: an unknown
    key is a ``key:NAME`` error with a suggestion), dropout 0, no cache."""
    cls = model_class(arch).config_class
    known = _known_keys(cls)
    try:
        config = cls(**keys)
    except Exception as e:  # noqa: BLE001 - the config's own validation (types, sizes that do not fit)
        text = " ".join(str(e).split())
        bad = next((k for k in keys if f"'{k}'" in text), None)   # a field named in the message
        raise HfModelError(f"key:{bad or ''}", f"{cls.__name__} refuses these keys: {text}") from None
    stray = config.to_dict()
    for k in keys:
        if k not in known and k in stray:   # consumed keys (legacy rope_theta) are not left as attributes
            raise HfModelError(f"key:{k}", f"'{k}' is not a key of {cls.__name__}{_suggest(k, known)}")
    return _finish(config, arch, keys)


def config_from_folder(folder: str):
    """The config of a local model folder (its config.json), dropout 0; its architecture."""
    if not os.path.isfile(os.path.join(folder, "config.json")):
        raise HfModelError("folder", f"{folder} has no config.json")
    tf = transformers()
    config = tf.AutoConfig.from_pretrained(folder, local_files_only=True)
    archs = list(getattr(config, "architectures", None) or [])
    if not archs:
        raise HfModelError("folder", f"{folder}/config.json names no architecture ('architectures')")
    model_class(archs[0])
    return _finish(config, archs[0]), archs[0]


def has_weights(folder: str) -> bool:
    return any(f.endswith((".safetensors", ".bin")) for f in os.listdir(folder))


def config_from_record(arch: str, full: dict):
    """The config plan.json records (``model.hf.config``: every key after defaults)."""
    cls = model_class(arch).config_class
    return _finish(cls.from_dict(dict(full)), arch)


def build_model(config, seed: int, folder: str | None = None, device=None, attn: str | None = None):
    """The causal LM as one process builds it, in training mode (dropout 0), fp32, with attention ``attn``
    (default :func:`attn_implementation`): initialized by the plan-independent rule (``hf_init``), then
    the folder's weights where it has them. ``device="meta"``: shapes only, no weights."""
    model = meta_model(config, attn)
    if device is not None and str(device) == "meta":
        return model
    weights = _weights(folder)
    done = (lambda name, module: _load_own(weights, name, module, recurse=False)) if weights else None
    hf_init.materialize(model, seed, done=done)
    if weights is not None:
        weights.close()
    return model


def meta_model(config, attn: str | None = None):
    """The causal LM on the meta device (no memory), in training mode."""
    tf = transformers()
    attn = attn or attn_implementation(config.architectures[0])
    with torch.device("meta"):
        model = tf.AutoModelForCausalLM.from_config(config, attn_implementation=attn)
    model.train()
    return model


def _weights(folder):
    if folder is None or not has_weights(folder):
        return None
    from .hf_weights import FolderWeights
    return FolderWeights(folder)


def _load_own(weights, name: str, module: nn.Module, recurse: bool) -> None:
    """The folder's values for ``module``'s parameters (its own, or its subtree's) that the folder has;
    the others keep their plan-independent initialization (as ``from_pretrained``'s missing keys)."""
    for local, p in module.named_parameters(recurse=recurse, remove_duplicate=False):
        key = f"{name}.{local}" if name else local
        if key in weights and not p.is_meta:
            weights.read_into(key, p)


def build_share(config, seed: int, held: range, tp=None, folder: str | None = None, attn: str | None = None,
                vocab=None):
    """The pipeline layers of the model with only ``held`` (layer indices) materialized: the others stay on
    the meta device. Each held module is drawn by the plan-independent rule (``hf_init``), a held decoder
    layer sharded for ``tp`` as soon as it is complete (so at most one whole module beyond the share is
    held at a time), then the folder's weights are read for it, its shard's bytes only (``hf_weights``).
    On a tensor stage the embedding table and ``lm_head`` are split by vocabulary (``hf_vocab``), padded
    to ``vocab``'s rows (plan.json ``train.model.hf.vocab``; None: to a multiple of ``tp.size``)."""
    model = meta_model(config, attn)
    layers = pipeline_layers(model)
    held_layers = [layers[i] for i in held]
    wanted = hf_init.needed_modules(model, held_layers)
    blocks = {id(layer.layer) for layer in held_layers if isinstance(layer, DecoderLayer)}
    roots = {name for name, m in model.named_modules() if id(m) in blocks}
    plan = None
    if tp is not None and tp.size > 1:
        from .hf_tp import layer_tp_plan, parallelize_layer
        plan = layer_tp_plan(config)
    weights = _weights(folder)
    vocab = _vocab_split(layers, held, tp, vocab)

    def done(name, module):
        if name in roots:   # a whole decoder layer: shard it, then read its shards
            if plan is not None:
                parallelize_layer(module, plan, tp)
            if weights is not None:
                _load_own(weights, name, module, recurse=True)
        elif weights is not None and not any(name.startswith(r + ".") for r in roots):
            _load_own(weights, name, module, recurse=False)
        if vocab and module is vocab["embedding"]:
            hf_vocab.split_embedding(module, tp, vocab["rows"])
        elif vocab and module is vocab["head"] and not vocab["tied"]:
            hf_vocab.split_head(module, tp, padded=vocab["head_rows"])

    hf_init.materialize(model, seed, wanted, done=done)
    if weights is not None:
        weights.close()
    if plan is not None and getattr(tp, "sequence_parallel", False):   # hidden states split along the sequence
        for i in held:
            layers[i].sequence = tp
    if vocab:
        head = vocab["head"]
        if head is None:
            pass   # the embedding alone (a tied head elsewhere took the split table from tie_weights: not held)
        elif vocab["tied"] and vocab["embedding"] is not None:   # the head takes the split table (tie_weights gave it)
            hf_vocab.split_head(head, tp, weight=vocab["embedding"].weight, padded=vocab["rows"], vocab=vocab["size"])
        elif vocab["tied"]:   # the head alone: its rows of the embedding's whole table
            table = vocab["table"]
            hf_vocab.split_head(head, tp, weight=hf_vocab.shard_rows(head.weight, tp, vocab["rows"]),
                                padded=vocab["rows"], vocab=vocab["size"])
            table.weight = head.weight   # the whole table goes; the (unheld) embedding keeps the tie
        if held.stop == len(layers):
            setattr(layers[-1], hf_vocab.VOCAB_ATTR, getattr(head, hf_vocab.VOCAB_ATTR))
    return layers


def _vocab_split(layers, held: range, tp, record=None) -> dict | None:
    """The embedding and head this rank splits by vocabulary (``hf_vocab.table_and_head``) and the rows it
    pads them to (``record``: plan.json's ``VocabSplit`` or its JSON; tied: one table), else None."""
    n = len(layers)
    if tp is None or tp.size <= 1 or not (0 in held or n - 1 in held):
        return None
    found = hf_vocab.table_and_head(layers)
    if found is None:
        return None
    emb, head = found
    tied = head.weight is emb.weight
    size = emb.weight.shape[0]
    rows = hf_vocab.padded_rows(size, tp.size, record, "embedding") if 0 in held or tied else None
    head_rows = rows if tied else (hf_vocab.padded_rows(head.out_features, tp.size, record, "lm_head")
                                   if n - 1 in held else None)
    return {"embedding": emb if 0 in held else None, "head": head if n - 1 in held else None, "table": emb,
            "tied": tied, "size": size, "rows": rows, "head_rows": head_rows}


def _names(prefix_local: str, prefix_hf: str, module: nn.Module) -> dict[str, str]:
    return {f"{prefix_local}.{n}": f"{prefix_hf}.{n}" if prefix_hf else n
            for n, _ in module.named_parameters(remove_duplicate=False)}


class Embeddings(nn.Module):
    """Layer 0: the base model's modules before its decoder layers, in the pp plan's order."""

    def __init__(self, parts: dict, base_prefix: str):
        super().__init__()
        self.parts = list(parts)
        self.planc_label = " + ".join(self.parts)   # how planc explain names the layer
        for name, mod in parts.items():
            self.add_module(name, mod)
        self.planc_param_names = {}
        for name, mod in parts.items():
            self.planc_param_names.update(_names(name, f"{base_prefix}.{name}".lstrip("."), mod))
        self.sequence = None   # a sequence-parallel stage's TensorParallel: the output is the rank's part

    def forward(self, ids):
        h = ids
        for name in self.parts:
            h = getattr(self, name)(h)
        return h if self.sequence is None else scatter_sequence(h, self.sequence)


def _mask_function(config, index: int):
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask
    types = getattr(config, "layer_types", None)
    if types:
        return create_sliding_window_causal_mask if types[index] == "sliding_attention" else create_causal_mask
    return create_sliding_window_causal_mask if getattr(config, "sliding_window", None) else create_causal_mask


class DecoderLayer(nn.Module):
    """Layers 1..L: one HF decoder layer, called as the base model's forward calls it."""

    def __init__(self, layer: nn.Module, rotary: nn.Module | None, config, index: int, hf_prefix: str):
        super().__init__()
        self.layer = layer
        if rotary is not None:   # no parameters (a buffer of inverse frequencies), shared by the layers
            self.rotary = rotary
        self.config, self.index = config, index
        self.planc_label = hf_prefix.split(".", 1)[-1] if "." in hf_prefix else hf_prefix
        self._mask = _mask_function(config, index)
        self.planc_param_names = _names("layer", hf_prefix, layer)
        self.sequence = None   # a sequence-parallel stage's TensorParallel: hidden is the rank's part of the sequence

    def forward(self, hidden):
        whole = hidden
        if self.sequence is not None:   # the mask and positions are the whole sequence's (the regions gather it)
            whole = hidden.new_zeros(()).expand(hidden.shape[0], hidden.shape[1] * self.sequence.size,
                                                *hidden.shape[2:])
        positions = torch.arange(whole.shape[1], device=hidden.device).unsqueeze(0)
        # on the meta device (the compile-time probe) HF's check for packed sequences cannot read the
        # positions: they are 0..T-1, one sequence per row, which is what it concludes on real tensors
        mask = self._mask(self.config, whole, None, None, position_ids=None if hidden.is_meta else positions)
        extra = {}
        if hasattr(self, "rotary"):
            extra["position_embeddings"] = self.rotary(whole, positions)
        out = self.layer(hidden, attention_mask=mask, position_ids=positions, use_cache=False, **extra)
        return out[0] if isinstance(out, tuple) else out


class Head(nn.Module):
    """Layer L + 1: the base model's modules after its decoder layers (the final norm), then the causal
    LM's ``_pp_plan`` modules (``lm_head``), and Gemma-2's final logit soft-capping where configured."""

    def __init__(self, after: dict, head: dict, base_prefix: str, softcap):
        super().__init__()
        self.parts = list(after) + list(head)
        self.planc_label = " + ".join(self.parts)
        self.planc_param_names = {}
        for name, mod in after.items():
            self.add_module(name, mod)
            self.planc_param_names.update(_names(name, f"{base_prefix}.{name}".lstrip("."), mod))
        for name, mod in head.items():
            self.add_module(name, mod)
            self.planc_param_names.update(_names(name, name, mod))
        self.softcap = softcap
        self.sequence = None   # a sequence-parallel stage's TensorParallel: hidden is the rank's part of the sequence

    def forward(self, hidden):
        # the rank's part gathered: the norm runs on the whole sequence, and the head either repeats on every
        # rank or (split by vocabulary) sums its input gradient over the group, so the gradient is whole
        h = hidden if self.sequence is None else gather_sequence_whole(hidden, self.sequence)
        for name in self.parts:
            h = getattr(self, name)(h)
        if self.softcap is not None:
            h = torch.tanh(h / self.softcap) * self.softcap
        return h


def pipeline_layers(model) -> list[nn.Module]:
    """The model's pipeline layers by its config's ``base_model_pp_plan`` (the module docstring)."""
    config = model.config
    prefix = model.base_model_prefix
    base = getattr(model, prefix, model)
    base_prefix = prefix if base is not model else ""
    plan = list(config.base_model_pp_plan)
    lists = [k for k in plan if isinstance(getattr(base, k, None), nn.ModuleList)]
    if len(lists) != 1:
        raise HfModelError("pp", f"{type(model).__name__}'s base_model_pp_plan {plan} does not name one list of "
                                 "decoder layers")
    at = plan.index(lists[0])
    before = {k: getattr(base, k) for k in plan[:at]}
    after = {k: getattr(base, k) for k in plan[at + 1:]}
    # the causal LM's own pipeline modules (its _pp_plan also lists the base model's, prefixed)
    head = {k: getattr(model, k) for k in (getattr(model, "_pp_plan", None) or {"lm_head": None}) if "." not in k}
    rotary = getattr(base, "rotary_emb", None)
    blocks = getattr(base, lists[0])[: config.num_hidden_layers]
    layers: list[nn.Module] = [Embeddings(before, base_prefix)]
    for i, block in enumerate(blocks):
        hf = ".".join(p for p in (base_prefix, lists[0], str(i)) if p)
        layers.append(DecoderLayer(block, rotary, config, i, hf))
    layers.append(Head(after, head, base_prefix, getattr(config, "final_logit_softcapping", None)))
    _one_name_per_tie(layers)
    return layers


def _one_name_per_tie(layers) -> None:
    """A parameter shared by several layers (``tie_word_embeddings``: ``lm_head.weight`` is the embedding)
    is named, in every layer holding it, by its first layer's HF name (``model.embed_tokens.weight``), as
    HF's own state dict stores a tied weight once: a checkpoint then holds it once, whichever stages hold it."""
    first: dict[int, str] = {}
    for layer in layers:
        for local, p in layer.named_parameters(remove_duplicate=False):
            name = layer.planc_param_names.get(local)
            if name is None:
                continue
            if id(p) in first:
                layer.planc_param_names[local] = first[id(p)]
            else:
                first[id(p)] = name


def builder(record: dict, out_dir: str, seed: int):
    """The model builder of plan.json's ``train.model.hf`` record: ``build(tensor_parallel=None,
    stage_layers=None)`` returns the pipeline layers, those in ``stage_layers`` (a range; None: all) materialized (:func:`build_share`),
    each decoder layer sharded by the config's ``base_model_tp_plan`` for a tensor context."""
    arch = record["architecture"]
    folder = record.get("folder")
    if folder is not None and not os.path.isabs(folder):
        folder = os.path.join(out_dir, folder)

    # the config (and with it transformers and the model's module) before the build: what a build costs is
    # measured from here (share.Peak), its imports are not part of it
    if folder is not None and not (arch and record.get("config")):   # compiled without the probe
        config, _ = config_from_folder(folder)
    else:
        config = config_from_record(arch, record["config"])
    import importlib
    importlib.import_module(model_class(config.architectures[0]).__module__)

    def build(tensor_parallel=None, stage_layers=None):
        # sequence parallelism: ``tensor_parallel.sequence_parallel`` (plan.json stages[i].sequence_parallel)
        held = range(config.num_hidden_layers + 2) if stage_layers is None else stage_layers
        return build_share(config, seed, held, tensor_parallel, folder, attn=record.get("attn_implementation"),
                           vocab=record.get("vocab"))
    return build


def causal_lm_loss(logits, labels):
    """HF's causal-LM loss (``ForCausalLMLoss``): logits at t predict labels at t + 1 (shifted here), the
    cross-entropy in fp32, averaged over the predicted tokens (labels -100 ignored)."""
    logits = logits.float()
    shifted = nn.functional.pad(labels, (0, 1), value=-100)[..., 1:].contiguous()
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), shifted.reshape(-1).to(logits.device),
                                       ignore_index=-100, reduction="mean")
