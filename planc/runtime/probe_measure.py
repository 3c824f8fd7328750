"""What the compile-time probe (``planc.runtime.probe``) measures per layer beyond shapes: FLOPs with
``torch.utils.flop_counter.FlopCounterMode`` (forward and backward), and the all-reduces one device of a
tensor group issues (through the stand-in tensor context). Works on real tensors and on the meta device
(a Hugging Face model probed without weights)."""
from __future__ import annotations

import torch

__all__ = ["count_flops", "measure_tensor_traffic", "first_rows"]


def _tensors(out):
    return list(out) if isinstance(out, (tuple, list)) else [out]


def _sdpa_cpu_mapping() -> dict:
    """FlopCounterMode counts the CUDA attention kernels; CPU runs its own, counted here the same way."""
    from torch.utils import flop_counter as fc
    out = {}
    fwd = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    bwd = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)
    if fwd is not None:
        out[fwd] = lambda q, k, v, *args, **kwargs: fc.sdpa_flop_count(q, k, v)
    if bwd is not None:
        out[bwd] = lambda g, q, k, v, *args, **kwargs: fc.sdpa_backward_flop_count(g, q, k, v)
    return out


def _leaf(v, grad: bool):
    if not torch.is_tensor(v):
        return v
    return v.detach().requires_grad_(grad and (v.is_floating_point() or v.is_complex()))


def count_flops(layers, inputs_of: dict, data_layer: int | None) -> tuple[list, list[str]]:
    """Per layer, [forward, backward] FLOPs of one run on the inputs it got (None where it did not run).

    The backward starts from all-ones gradients of every floating-point output and flows into the
    parameters and every floating-point input except those of ``data_layer`` (the one fed the data)."""
    from torch.utils.flop_counter import FlopCounterMode
    mapping = _sdpa_cpu_mapping()
    out: list = []
    errors: list[str] = []
    for i, layer in enumerate(layers):
        if i not in inputs_of:
            out.append(None)
            continue
        try:
            with torch.enable_grad():
                args = tuple(_leaf(v, i != data_layer) for v in inputs_of[i])
                counter = FlopCounterMode(display=False, custom_mapping=mapping)
                with counter:
                    y = layer(*args)
                fwd = counter.get_total_flops()
                ys = [t for t in _tensors(y) if torch.is_tensor(t) and t.requires_grad]
                bwd = 0
                if ys:
                    counter = FlopCounterMode(display=False, custom_mapping=mapping)
                    with counter:
                        torch.autograd.backward(ys, [torch.ones_like(t) for t in ys])
                    bwd = counter.get_total_flops()
            out.append([int(fwd), int(bwd)])
        except Exception as e:  # noqa: BLE001 - a layer that cannot be differentiated: its FLOPs are unknown
            errors.append(f"layer {i} ({type(layer).__name__}): {type(e).__name__}: {e}")
            out.append(None)
        finally:
            for p in layer.parameters():
                p.grad = None
    return out, errors


def first_rows(v, micro_batch: int, rows: int):
    """A layer input as one device of a data axis sees it: the first ``rows`` of a batch-first tensor."""
    if torch.is_tensor(v) and v.dim() and v.shape[0] == micro_batch and rows < micro_batch:
        return v[:rows]
    return v


def measure_tensor_traffic(layers, tp, lo: int, hi: int, inputs_of: dict,
                           micro_batch: int, rows: int, data_layer: int | None) -> dict:
    """The all-reduces one device of a tensor group issues for one micro-batch of stage layers
    ``lo..hi`` (sharded ``layers``, built with ``tp``): each layer runs on the inputs it got in the
    probe's run, cut to the device's ``rows``, forward with gradients, then backward from all-ones
    output gradients (into the parameters and every floating-point input but the data's). Returns
    ``{"forward": [bytes, ...], "backward": [bytes, ...], "errors": [...]}``, in issue order."""
    out: dict = {"forward": [], "backward": [], "errors": []}
    for i in range(lo, hi):
        if i not in inputs_of:
            out["errors"].append(f"layer {i} did not run")
            continue
        layer = layers[i]
        try:
            with torch.enable_grad():
                args = tuple(_leaf(first_rows(v, micro_batch, rows), i != data_layer) for v in inputs_of[i])
                tp.log, tp.phase = [], "forward"
                y = layer(*args)
                ys = [t for t in _tensors(y) if torch.is_tensor(t) and t.requires_grad]
                tp.phase = "backward"
                if ys:
                    torch.autograd.backward(ys, [torch.ones_like(t) for t in ys])
            for phase, nbytes in tp.log:
                out[phase].append(nbytes)
        except Exception as e:  # noqa: BLE001 - its traffic is unknown; say why
            out["errors"].append(f"layer {i} ({type(layer).__name__}): {type(e).__name__}: {e}")
        finally:
            tp.phase, tp.log = None, []
            for p in layer.parameters():
                p.grad = None
    return out
