"""Hugging Face ``transformers``' GPT-2 as pipeline layers: a real third-party model.

``build(layers, hidden, heads, seq, vocab)`` builds one ``GPT2LMHeadModel`` from a
``GPT2Config`` (randomly initialised by torch's generator, which planc seeds with
``train.seed`` before calling the builder; no weights and no tokenizer are downloaded)
and hands its own modules out as ``layers + 2`` pipeline layers:

===  ==========  ==================================  ==========================
idx  layer       holds (the HF modules themselves)   maps
===  ==========  ==================================  ==========================
0    Embeddings  ``transformer.wte, .wpe, .drop``    ids [B, T] -> h [B, T, H]
1..  Block       ``transformer.h[i]`` (a GPT2Block)  h -> h
L+1  Head        ``transformer.ln_f``, ``lm_head``   h -> logits [B, T, V]
===  ==========  ==================================  ==========================

Every layer runs the HF module's own forward exactly as ``GPT2Model.forward`` calls it
(positions ``0..T-1``; each block gets the causal mask made by HF's
``create_causal_mask`` for the config's attention implementation), so the layers in a
chain compute ``GPT2LMHeadModel(ids).logits``. Dropout probabilities are 0: training
with dropout would not be deterministic, and a pipeline cannot be compared with one
process then.

Tied embeddings: GPT-2 ties ``lm_head.weight`` to ``wte.weight`` (``tie_word_embeddings = True``,
HF's default): the head's weight *is* the embedding's ``nn.Parameter``. The embedding is the first
layer and the head the last, so on a plan with several stages the first and the last stage each hold
a copy; planc's probe finds the parameter reachable from both layers and the compiler plans one more
reduction for it, over the devices of both stages, which sums its gradient over every stage and data
replica after the last backward (docs/reduction.md, "Tied parameters"). Both copies then take the
same step, as the single-process ``GPT2LMHeadModel`` (same seed, same tied config) does.

``loss(logits, labels)`` is HF's causal-LM loss: logits at position t predict token t+1
(the labels are the input ids, shifted inside the loss), cross-entropy averaged over
every predicted token. ``batches(micro_batch, seed, seq, vocab)`` yields ``(ids, ids)``
of a seeded synthetic language (each next token is a fixed function of the current one).

The builder does not take ``tensor_parallel``: on a stage with a ``tensor`` axis its
layers are replicas (see docs/models.md; examples/gpt.py shows the opt-in).
"""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")        # never reach the Hub: the model is built from a config
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

import torch  # noqa: E402
from torch import nn  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel  # noqa: E402
from transformers.masking_utils import create_causal_mask  # noqa: E402

ATTENTION = "sdpa"


def config(layers=2, hidden=16, heads=2, seq=8, vocab=32):
    """The GPT2Config of these model arguments: no dropout, tied embeddings (see the module doc)."""
    return GPT2Config(n_layer=layers, n_embd=hidden, n_head=heads, n_positions=seq, vocab_size=vocab,
                      bos_token_id=vocab - 1, eos_token_id=vocab - 1, resid_pdrop=0.0, embd_pdrop=0.0,
                      attn_pdrop=0.0, tie_word_embeddings=True, use_cache=False, attn_implementation=ATTENTION)


def _positions(hidden):
    return torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)


class Embeddings(nn.Module):
    """``wte(ids) + wpe(positions)``, then the embedding dropout, as in ``GPT2Model.forward``."""

    def __init__(self, transformer):
        super().__init__()
        self.wte, self.wpe, self.drop = transformer.wte, transformer.wpe, transformer.drop

    def forward(self, ids):
        embeds = self.wte(ids)
        return self.drop(embeds + self.wpe(_positions(embeds)))


class Block(nn.Module):
    """One ``GPT2Block``, called with the causal mask HF builds for its attention implementation."""

    def __init__(self, block, cfg):
        super().__init__()
        self.block = block
        self.cfg = cfg

    def forward(self, hidden):
        positions = _positions(hidden)
        mask = create_causal_mask(config=self.cfg, inputs_embeds=hidden, attention_mask=None, cache=None,
                                  position_ids=positions)
        out = self.block(hidden, None, mask, None, use_cache=False, position_ids=positions)
        return out[0] if isinstance(out, tuple) else out   # transformers 4.x returned a tuple


class Head(nn.Module):
    """The final layer norm and the language-model head (its weight tied to the embedding's ``wte``)."""

    def __init__(self, transformer, lm_head):
        super().__init__()
        self.ln_f, self.lm_head = transformer.ln_f, lm_head

    def forward(self, hidden):
        return self.lm_head(self.ln_f(hidden))


def build(layers=2, hidden=16, heads=2, seq=8, vocab=32):
    if hidden % heads:
        raise ValueError(f"hidden = {hidden} is not a multiple of heads = {heads}")
    cfg = config(layers, hidden, heads, seq, vocab)
    model = GPT2LMHeadModel(cfg)           # HF's own initialisation, from torch's (seeded) generator
    t = model.transformer
    return [Embeddings(t)] + [Block(b, t.config) for b in t.h] + [Head(t, model.lm_head)]


def loss(logits, labels):
    """HF's causal-LM loss: position t predicts token t+1; the mean over every predicted token."""
    vocab = logits.shape[-1]
    return nn.functional.cross_entropy(logits[:, :-1].reshape(-1, vocab).float(), labels[:, 1:].reshape(-1))


def batches(micro_batch, seed, seq=8, vocab=32, **_):
    """Endless seeded synthetic token rows ``(ids, labels = ids)``: token t+1 = (5 * token t + 1) mod vocab."""
    g = torch.Generator().manual_seed(seed)
    while True:
        ids = torch.empty(micro_batch, seq, dtype=torch.long)
        ids[:, 0] = torch.randint(0, vocab, (micro_batch,), generator=g)
        for t in range(1, seq):
            ids[:, t] = (ids[:, t - 1] * 5 + 1) % vocab
        yield ids, ids.clone()
