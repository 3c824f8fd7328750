"""The compile-time probe of a Hugging Face model (``model hf ...``), on the meta device: no weights are
ever allocated, so a model of any size is measured in seconds and a few hundred MB.

``probe_hf(req, ...)`` answers the same JSON request as ``planc.runtime.probe._request`` (its ``hf`` key:
``{"architecture", "keys"}`` or ``{"folder"}``) with the same answer, plus ``hf``: the architecture, the
config after defaults (dropout 0: what the runtime builds from), the attention implementation and
whether the folder has weights. What it does:

- builds the config (an unknown architecture or key, a folder without config.json, a config without a
  ``base_model_pp_plan`` fail with the tags ``hf-arch``, ``hf-key:NAME``, ``hf-folder``, ``hf-pp``,
  which the compiler locates at the plan's string or key) and the model with ``from_config`` under
  ``torch.device("meta")``, cut into pipeline layers (``planc.runtime.hf``);
- draws the data function's batches as the runtime will (real tensors, checked: integer token ids of
  ``[micro_batch, T]`` below the vocabulary size), then runs the plan's dataflow on their meta copies:
  shapes, output bytes, autograd's saved storages per layer, FLOPs (``FlopCounterMode`` works on meta);
- calls the loss (the plan's, or ``causal_lm_loss``) on the last layer's meta output: one value that
  requires grad, and its backward runs. Skipped on meta: the loss's value (its finiteness) and the
  per-device row slices of each stage (the layers are HF's own and take any number of rows);
- per tensor degree, what one device holds per layer (``colwise`` Linears keep 1/k of their weight and
  bias, ``rowwise`` 1/k of their weight, by the config's ``base_model_tp_plan``), and the tensor
  traffic from ``hf_tp.layer_traffic`` when that module is there (else an ``errors`` entry says so).
"""
from __future__ import annotations

import json
import os
import re

import torch

from .hf_vocab import table_and_head
from .hf import HfModelError, attn_implementation, build_model, causal_lm_loss, config_from_folder, \
    config_from_keys, has_weights, pipeline_layers
from .probe_measure import count_flops
from .tensor_parallel import TensorParallel
from .tied import probe_record as tied_record
from .usererrors import UserCodeError, draw_batches, shapes

__all__ = ["probe_hf", "layer_tp_plan_of", "sharded_params"]


def _config(spec: dict):
    try:
        if spec.get("folder"):
            config, arch = config_from_folder(spec["folder"])
        else:
            arch = spec["architecture"]
            config = config_from_keys(arch, dict(spec.get("keys") or {}))
    except HfModelError as e:
        raise UserCodeError(f"hf-{e.part}", str(e)) from None
    return config, arch


def layer_tp_plan_of(config) -> dict[str, str]:
    """The config's ``base_model_tp_plan`` entries of one decoder layer (``layers.*.X`` as ``X``)."""
    plan = getattr(config, "base_model_tp_plan", None) or {}
    return {k.split(".", 2)[2]: v for k, v in plan.items() if k.startswith("layers.*.")}


def vocab_padding(layers, req: dict) -> dict[str, int]:
    """The rows the embedding table and ``lm_head`` are padded to (plan.json ``train.model.hf.vocab``, by
    ``planc.plan.padded_vocab``): per part, to the tensor degrees of the stages holding it (both parts to
    their least common multiple when one table is tied across stages). From the request's stages and
    tensor stages; empty when the stages are not cut yet (each degree then pads to itself)."""
    from planc.plan import padded_vocab
    found = table_and_head(layers)
    ranges = req.get("stages") or [None]
    if found is None or ranges == [None] and len(req.get("tensor_stages") or ()) > 1:
        return {}
    n = len(layers)
    degree = {}
    for st in req.get("tensor_stages") or ():
        lo, hi = (0, n) if st.get("layers") is None else (int(st["layers"][0]), int(st["layers"][1]))
        for i in (0, n - 1):
            if lo <= i < hi:
                degree[i] = int(st["degree"])
    emb, head = found
    k0, k1 = degree.get(0, 1), degree.get(n - 1, 1)
    vocab = int(emb.weight.shape[0])
    if head.weight is emb.weight:
        return {"embedding": padded_vocab(vocab, (k0, k1)), "lm_head": padded_vocab(vocab, (k0, k1))}
    return {"embedding": padded_vocab(vocab, (k0,)), "lm_head": padded_vocab(int(head.out_features), (k1,))}


def _vocab_rows(layers, k: int, pads: dict) -> dict[int, int]:
    """Per parameter id of the embedding table and head, what one device of a tensor group of ``k`` keeps
    of it (``hf_vocab``: its rows of the table padded to ``pads``' rows, else to a multiple of ``k``)."""
    found = table_and_head(layers) if k > 1 else None
    if found is None:
        return {}
    emb, head = found
    out = {}
    for part, p in (("embedding", emb.weight), ("lm_head", head.weight), ("lm_head", head.bias)):
        if p is None or id(p) in out:
            continue
        vocab = int(p.shape[0])
        padded = pads.get(part, 0)
        rows = padded // k if padded and padded % k == 0 else -(-vocab // k)
        out[id(p)] = p.numel() // vocab * rows
    return out


def sharded_params(layers, config, k: int, pads: dict | None = None) -> list[int]:
    """Per layer, the parameters one device of a tensor group of ``k`` holds: in each decoder layer the
    plan's ``colwise`` modules keep 1/k of each parameter, ``rowwise`` ones 1/k of their weight; the
    embedding table and lm_head their rows of the padded vocabulary (``_vocab_rows``)."""
    plan = layer_tp_plan_of(config)
    out = []
    vocab = _vocab_rows(layers, k, pads or {})
    for i, layer in enumerate(layers):
        if not 0 < i < len(layers) - 1:   # the embedding table and lm_head split by vocabulary (hf_vocab)
            out.append(sum(vocab.get(id(p), p.numel()) for p in layer.parameters()))
            continue
        n = 0
        for name, mod in layer.layer.named_modules():
            style = plan.get(name, "")
            for pname, p in mod.named_parameters(recurse=False):
                split = "colwise" in style or ("rowwise" in style and pname == "weight")
                n += p.numel() // k if split else p.numel()
        out.append(n)
    return out


class _MetaTensorParallel(TensorParallel):
    """A tensor group on the meta device (rank 0): collectives are identities, so a split build runs and
    autograd's saved tensors show what one device keeps."""

    def all_reduce(self, t):
        return t

    def all_gather_seq(self, x):
        return torch.cat([x] * self.size, dim=1)

    def reduce_scatter_seq(self, x):
        return x.narrow(1, 0, x.shape[1] // self.size).contiguous()


def _split_on_meta(layers, config, k: int, pads: dict, sequence: bool = False):
    """A copy of the meta layers split as a tensor rank of ``k`` splits them (decoder layers by the tp plan,
    the embedding table and head by vocabulary, padded), to measure what it saves."""
    import copy
    from .hf_tp import layer_tp_plan, parallelize_layer
    from .hf_vocab import split_embedding, split_head
    out = copy.deepcopy(layers)
    tp = _MetaTensorParallel(None, 0, k)
    tp.sequence_parallel = sequence
    plan = layer_tp_plan(config)
    for layer in out[1:-1]:
        parallelize_layer(layer.layer, plan, tp)
    if sequence:   # hidden states split along the sequence between the layers (hf.build_share)
        for layer in out:
            layer.sequence = tp
    found = table_and_head(out)
    if found is not None:
        emb, head = found
        tied = head.weight is emb.weight
        rows = {part: pads[part] if pads.get(part, 0) % k == 0 and pads.get(part) else None
                for part in ("embedding", "lm_head")}
        vocab = int(emb.weight.shape[0])
        split_embedding(emb, tp, rows["embedding"])
        split_head(head, tp, weight=emb.weight if tied else None, padded=rows["embedding" if tied else "lm_head"],
                   vocab=vocab if tied else None)
    return out


def _traffic(config, layers, st: dict, seq: int) -> dict:
    rec = {"stage": int(st["stage"]), "degree": int(st["degree"]), "rows": int(st["rows"]),
           "forward": [], "backward": [], "errors": []}
    try:
        from .hf_tp import layer_traffic   # written beside planc_runtime.hf (issue 35)
    except ImportError:
        rec["errors"].append("planc_runtime.hf_tp is missing: the tensor traffic of Hugging Face layers is not "
                             "measured")
        return rec
    lo, hi = (0, len(layers)) if st.get("layers") is None else (int(st["layers"][0]), int(st["layers"][1]))
    decoders = [i for i in range(lo, min(hi, len(layers))) if 0 < i < len(layers) - 1]
    vocab = rec["degree"] > 1 and table_and_head(layers) is not None
    tokens = rec["rows"] * seq * 4   # fp32 activations, as below
    if lo == 0 and vocab:   # the split embedding's partial lookups summed (g)
        rec["forward"].append(tokens * config.hidden_size)
    head = hi >= len(layers) and bool(vocab)
    if head:   # the split head's input gradient (f), first in backward
        rec["backward"].append(tokens * config.hidden_size)
    if decoders:
        try:   # every decoder layer of a config is alike: one measurement, repeated per layer
            t = layer_traffic(config, int(st["rows"]), seq, 4)   # the probe's activations are fp32
        except Exception as e:  # noqa: BLE001 - its traffic is unknown; say why
            rec["errors"].append(f"layers {decoders[0]}..{decoders[-1] + 1}: {type(e).__name__}: {e}")
            return rec
        for i in decoders:
            rec["forward"] += [int(b) for b in t.get("forward", ())]
            rec["backward"] += [int(b) for b in t.get("backward", ())]
            rec["errors"] += [f"layer {i}: {e}" for e in t.get("errors", ())]
    if head:   # the parallel cross-entropy: the max, then the sum and the target's logit, a float per token
        rec["forward"] += [tokens, 2 * tokens]
    if seq % rec["degree"] == 0 and not rec["errors"]:
        rec["sequence"] = _sequence_traffic(config, rec, lo, hi, len(layers), decoders, tokens, bool(vocab), seq)
    return rec


def _sequence_traffic(config, rec: dict, lo: int, hi: int, n: int, decoders, tokens: int, vocab: bool,
                      seq: int) -> dict:
    """The same stage sequence-parallel (``hf_tp`` module docstring): ``forward``/``backward`` bytes with
    their ``*_kinds``, in the order issued (a decoder layer's norm gradient sums last in its backward)."""
    from .hf_tp import layer_traffic
    fwd, bwd = [], []   # (kind, bytes); bwd in forward order, reversed at the end
    width = tokens * config.hidden_size
    if lo == 0:   # the embedding: its partial lookups summed (split by vocabulary), then the rank's part
        if vocab:
            fwd.append(("all_reduce", width))
        bwd.append(("all_gather", width))   # the part's gradient gathered back to the whole sequence
    t = layer_traffic(config, int(rec["rows"]), seq, 4, sequence=True) if decoders else None
    if t is not None and t.get("errors"):
        return {"errors": [f"layers {decoders[0]}..{decoders[-1] + 1}: {e}" for e in t["errors"]]}
    for _ in decoders:
        fwd += list(zip(t["forward_kinds"], t["forward"]))
        bwd += list(zip(t["backward_kinds"], t["backward"]))[::-1]
    if hi >= n:   # the head gathers the whole sequence (its gradient comes back whole: no message)
        fwd.append(("all_gather", width))
        if vocab:
            bwd.append(("all_reduce", width))   # the split head's input gradient (f)
            fwd += [("all_reduce", tokens), ("all_reduce", 2 * tokens)]   # the parallel cross-entropy
    bwd = bwd[::-1]
    return {"forward": [b for _, b in fwd], "forward_kinds": [k for k, _ in fwd],
            "backward": [b for _, b in bwd], "backward_kinds": [k for k, _ in bwd], "errors": []}


def _check_ids(x, config) -> None:
    vocab = int(config.vocab_size)
    if x.dtype.is_floating_point or x.dtype == torch.bool or x.dim() != 2:
        raise UserCodeError("data-use", f"its inputs are ({shapes(x)}), but a causal LM takes token ids: an integer "
                                        "tensor [micro_batch, sequence]")
    if x.numel() and (int(x.min()) < 0 or int(x.max()) >= vocab):
        raise UserCodeError("data-use", f"its token ids range over {int(x.min())}..{int(x.max())}, outside the "
                                        f"model's vocabulary 0..{vocab - 1} (vocab_size = {vocab})")


def _check_loss(loss_fn, out, target) -> None:
    """The loss on the last layer's (meta) output: one value that requires grad, and its backward runs."""
    logits = out.detach().requires_grad_(True)
    try:
        with torch.enable_grad():
            loss = loss_fn(logits, target)
            ok = torch.is_tensor(loss) and loss.numel() == 1 and loss.requires_grad
            if ok:
                loss.backward()
    except Exception as e:  # noqa: BLE001 - the user's loss
        raise UserCodeError("loss-use", f"failed on output ({shapes(logits)}) and target ({shapes(target)}): "
                                        f"{type(e).__name__}: {e}") from e
    if not ok:
        got = shapes(loss) if torch.is_tensor(loss) else type(loss).__name__
        raise UserCodeError("loss-use", f"returned {got}: expected one value that depends on the output")


def _meta_layers(config, arch: str, keys: dict, seed: int, part):
    """The pipeline layers on the meta device. An assertion transformers or torch makes on a config value
    while building (config values ``hf.config_from_keys`` does not know to check) is the config's error, at
    the plan's key the message names, else at the model line; not a failure of the model's code."""
    try:
        model = build_model(config, seed, device="meta")
    except (AssertionError, ValueError, RuntimeError) as e:
        text = " ".join(str(e).split()) or "(no message)"
        named = [k for k in _jsonable(config) if re.search(rf"\b{re.escape(k)}\b", text)]
        key = next((k for k in named if k in keys), "")
        hint = f" (check {', '.join(named)})" if named else ""
        raise UserCodeError(f"hf-key:{key}", f"transformers cannot build {arch} with this config, it says "
                                             f"{type(e).__name__}: {text}{hint}") from None
    with part("model"):
        return pipeline_layers(model)


def _jsonable(config) -> dict:
    return json.loads(config.to_json_string(use_diff=False))


def probe_hf(req: dict, run_graph, saved_by_layer, load, part) -> dict:
    """The answer to a probe request whose model is a Hugging Face one (module docstring). ``run_graph``,
    ``saved_by_layer``, ``load`` and ``part`` are ``planc.runtime.probe``'s."""
    seed, micro_batch = int(req.get("seed", 0)), int(req["micro_batch"])
    spec = req["hf"]
    roots = sorted({os.path.dirname(os.path.abspath(req[k])) for k in ("data_file", "loss_file") if req.get(k)})
    config, arch = _config(spec)
    layers = _meta_layers(config, arch, dict(spec.get("keys") or {}), seed, part)
    with part("data", roots):
        data_fn = load(req["data_file"], req["data_function"])
    loss_fn = causal_lm_loss
    if req.get("loss_function"):
        with part("loss", roots):
            loss_fn = load(req["loss_file"], req["loss_function"])
    ex = req.get("exercise")
    with part("data", roots):
        batches = draw_batches(data_fn, micro_batch, seed, dict(req.get("data_args") or {}),
                               int(ex["micro_batches"]) if ex else 1, roots)
    x, y = batches[0]
    _check_ids(x, config)
    x, y = x.to("meta"), y.to("meta")
    transfers = [dict(t) for t in req.get("transfers", [])]
    stages = [(0, len(layers)) if r is None else (int(r[0]), int(r[1])) for r in (req.get("stages") or [None])]
    inputs_of: dict[int, tuple] = {}
    outputs, sent, errors = run_graph(layers, x, stages, transfers, inputs_of)
    if len(layers) - 1 in outputs:
        _check_loss(loss_fn, outputs[len(layers) - 1], y)
    # counted always (cheap on meta): planc explain lists every layer's; the cost model gets them when asked
    flops, flop_errors = count_flops(layers, inputs_of, stages[0][0] if stages else None)
    listing = [{"name": layer.planc_label, "params": sum(p.numel() for p in layer.parameters()), "flops": f}
               for layer, f in zip(layers, flops)]
    if not req.get("flops"):
        flops, flop_errors = None, []

    def first(i):
        out = outputs.get(i)
        return out[0] if isinstance(out, (tuple, list)) else out

    names = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16", torch.float64: "f64"}
    layer_outputs = [{"shape": list(first(i).shape), "dtype": names.get(first(i).dtype, str(first(i).dtype))}
                     if torch.is_tensor(first(i)) else None for i in range(len(layers))]
    measured = []
    for t in transfers:
        v = sent.get(t["name"])
        measured.append({"name": t["name"], "shape": list(v.shape), "dtype": names.get(v.dtype, str(v.dtype)),
                         "error": None} if torch.is_tensor(v) else
                        {"name": t["name"], "shape": None, "dtype": None,
                         "error": errors[0] if errors else "its layer did not run"})
    degrees = sorted({int(k) for k in req.get("tensor_degrees", ()) if int(k) > 1})
    pads = vocab_padding(layers, req)
    sharded = {str(k): sharded_params(layers, config, k, pads) for k in degrees}
    shard_errors, split_saved, sequence_errors, sequence_saved = {}, {}, {}, {}
    try:
        from .hf_tp import check_degree   # what the runtime's tensor parallelism refuses (issue 35)
        shard_errors = {str(k): why for k in degrees if (why := check_degree(config, k))}
        from .hf_tp import check_sequence
        seq = int(x.shape[1])
        sequence_errors = {str(k): (check_sequence(config, k) or
                                    (f"the sequence length {seq} does not split into {k} equal parts" if seq % k else None))
                           for k in degrees if str(k) not in shard_errors}
        sequence_errors = {k: why for k, why in sequence_errors.items() if why}
        sequence_saved = {} if errors else {str(k): saved_by_layer(_split_on_meta(layers, config, k, pads, True),
                                                                   x, stages, transfers)
                                            for k in degrees if str(k) not in shard_errors and str(k) not in sequence_errors}
        # what one device of each degree the runtime can split keeps for backward (memory model)
        split_saved = {} if errors else {str(k): saved_by_layer(_split_on_meta(layers, config, k, pads),
                                                                x, stages, transfers)
                                         for k in degrees if str(k) not in shard_errors}
    except ImportError:
        pass
    traffic = [_traffic(config, layers, st, int(x.shape[1]))
               for st in req.get("tensor_stages", ())
               if st.get("layers") is None or int(st["layers"][0]) < len(layers)]
    folder = spec.get("folder")
    return {"layer_params": [sum(p.numel() for p in layer.parameters()) for layer in layers],
            "layer_outputs": layer_outputs,
            "layer_output_bytes": [sum(t.numel() * t.element_size() for t in
                                       (outputs[i] if isinstance(outputs[i], (tuple, list)) else [outputs[i]])
                                       if torch.is_tensor(t)) if i in outputs else None for i in range(len(layers))],
            "layer_saved": saved_by_layer(layers, x, stages, transfers) if not errors else [],
            "sharded_layer_saved": split_saved,
            # sequence parallelism per tensor degree: why a degree cannot run it, what a device saves when it does
            "sequence_errors": sequence_errors, "sequence_layer_saved": sequence_saved,
            "layer_flops": flops, "flop_errors": flop_errors, "transfers": measured,
            "tensor_parallel": True, "sharded_layer_params": sharded, "shard_errors": shard_errors,
            "tensor_traffic": sorted(traffic, key=lambda t: t["stage"]), "graph_errors": errors,
            "tied": tied_record(layers),   # tie_word_embeddings: the embedding is lm_head's weight (tied.py)
            "hf": {"architecture": arch, "attn_implementation": attn_implementation(arch),
                   "config": _jsonable(config), "weights": bool(folder) and has_weights(folder),
                   "tp_plan": layer_tp_plan_of(config), "layers": listing}}
