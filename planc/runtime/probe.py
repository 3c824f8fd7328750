"""Size a model at compile time: parameter counts and output shapes per layer.

    python -m planc_runtime.probe '{"model_file": .., "function": .., "args": {..},
        "data_file": .., "data_function": .., "micro_batch": 8, "seed": 0}'
        -> {"layer_params": [...], "layer_shapes": [[8, 32, 64], ..., null]}   (planc.compile)

    python -m planc_runtime.probe MODEL_FILE FUNCTION JSON_ARGS MICRO_BATCH \\
        [--data FILE:FUNCTION] [--seed N] [--graph JSON]

(from a checkout: ``python -m planc.runtime.probe ...``). Prints one JSON
object on stdout::

    {"layers": [{"index": 0, "params": 1234, "output_shapes": [[8, 32, 64]],
                 "output_dtypes": ["f32"]}, ...],
     "params": 5678, "param_bytes": 22712,
     "stages": [{"index": 0, "layers": [0, 3], "params": 999, "param_bytes": 3996}],
     "transfers": [{"name": "hidden", "shape": [8, 32, 64], "dtype": "f32"}]}

``output_shapes`` lists one shape per tensor a layer returns (a tuple output
gives several). Shapes are for one whole micro-batch of ``MICRO_BATCH`` rows
from the data function (default: ``batches`` in MODEL_FILE). Without
``--graph`` the layers run in a chain (each gets the previous output);
``--graph '{"stages": [[0, 3], [3, 6]], "transfers": [{"name": ..,
"src_stage": 0, "src_layer": null, "dst_stage": 1}]}'`` runs the plan's
stage dataflow instead (skips, multi-input stages), and reports each
transfer's shape and dtype. Exit status 2 with a message on stderr when the
model cannot be built or run. Runs on CPU, no process group, no gradients.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys

import torch

DTYPE_NAMES = {torch.float64: "f64", torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16",
               torch.int64: "i64", torch.int32: "i32", torch.int16: "i16", torch.int8: "i8",
               torch.uint8: "u8", torch.bool: "bool"}


def _load(path: str, function: str):
    name = "planc_probe_" + os.path.splitext(os.path.basename(path))[0]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None:
        raise FileNotFoundError(path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return getattr(mod, function)


def _tensors(out):
    return list(out) if isinstance(out, (tuple, list)) else [out]


def probe(model_file, function, args: dict, micro_batch: int, data=None, seed=0, graph=None) -> dict:
    torch.manual_seed(seed)
    layers = _load(model_file, function)(**args)
    data_file, data_fn = (data.rsplit(":", 1) if data else (model_file, "batches"))
    x, _ = next(_load(data_file, data_fn)(micro_batch, seed, **args))
    outputs: dict[int, object] = {}
    with torch.no_grad():
        if graph is None:
            a = (x,)
            for i, layer in enumerate(layers):
                out = layer(*a)
                outputs[i] = out
                a = tuple(_tensors(out))
        else:
            sent = {}
            transfers = graph.get("transfers", [])
            for s, (lo, hi) in enumerate(graph["stages"]):
                inputs = (x,) if s == 0 else tuple(sent[t["name"]] for t in transfers if t["dst_stage"] == s)
                a = inputs
                for i in range(lo, hi):
                    out = layers[i](*a)
                    outputs[i] = out
                    a = tuple(_tensors(out))
                for t in transfers:
                    if t["src_stage"] == s:
                        layer = hi - 1 if t.get("src_layer") is None else int(t["src_layer"])
                        sent[t["name"]] = outputs[layer]
    result = {"layers": [], "params": 0, "param_bytes": 0}
    for i, layer in enumerate(layers):
        n = sum(p.numel() for p in layer.parameters())
        nb = sum(p.numel() * p.element_size() for p in layer.parameters())
        rec = {"index": i, "params": n, "param_bytes": nb}
        if i in outputs:
            ts = _tensors(outputs[i])
            rec["output_shapes"] = [list(t.shape) for t in ts]
            rec["output_dtypes"] = [DTYPE_NAMES.get(t.dtype, str(t.dtype)) for t in ts]
        result["layers"].append(rec)
        result["params"] += n
        result["param_bytes"] += nb
    if graph is not None:
        result["stages"] = [{"index": s, "layers": [lo, hi],
                             "params": sum(result["layers"][i]["params"] for i in range(lo, hi)),
                             "param_bytes": sum(result["layers"][i]["param_bytes"] for i in range(lo, hi))}
                            for s, (lo, hi) in enumerate(graph["stages"])]
        result["transfers"] = []
        for t in graph.get("transfers", []):
            v = sent.get(t["name"])
            rec = {"name": t["name"]}
            if torch.is_tensor(v):
                rec.update(shape=list(v.shape), dtype=DTYPE_NAMES.get(v.dtype, str(v.dtype)))
            else:
                rec.update(shape=None, dtype=None, error=f"layer output is {type(v).__name__}, not a tensor")
            result["transfers"].append(rec)
    return result


def _request(req: dict) -> dict:
    """planc.compile's form: one JSON request, answer {"layer_params", "layer_shapes"} (chain order).

    A layer that cannot run in a chain (it needs a skip input) and every layer
    after it get shape null; the compiler then skips their shape checks.
    """
    torch.manual_seed(int(req.get("seed", 0)))
    layers = _load(req["model_file"], req["function"])(**req.get("args", {}))
    data_file = req.get("data_file") or req["model_file"]
    x, _ = next(_load(data_file, req.get("data_function") or "batches")(
        int(req["micro_batch"]), int(req.get("seed", 0)), **req.get("args", {})))
    shapes, a = [], (x,)
    with torch.no_grad():
        for layer in layers:
            if a is None:
                shapes.append(None)
                continue
            try:
                out = layer(*a)
            except Exception:  # noqa: BLE001 - needs inputs from another stage
                shapes.append(None)
                a = None
                continue
            first = _tensors(out)[0]
            shapes.append(list(first.shape) if torch.is_tensor(first) else None)
            a = tuple(_tensors(out))
    return {"layer_params": [sum(p.numel() for p in l.parameters()) for l in layers], "layer_shapes": shapes}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) == 1 and argv[0].lstrip().startswith("{"):
        try:
            out = _request(json.loads(argv[0]))
        except Exception as e:  # noqa: BLE001
            print(f"probe: {type(e).__name__}: {e}", file=sys.stderr)
            return 2
        print(json.dumps(out, sort_keys=True))
        return 0
    p = argparse.ArgumentParser(prog="probe", description=__doc__.split("\n\n")[0])
    p.add_argument("model_file")
    p.add_argument("function")
    p.add_argument("json_args", help='keyword arguments of FUNCTION as JSON, e.g. \'{"layers": 4}\'')
    p.add_argument("micro_batch", type=int)
    p.add_argument("--data", default=None, help="FILE:FUNCTION of the batch generator")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--graph", default=None, help="stage ranges and transfers as JSON")
    a = p.parse_args(argv)
    try:
        out = probe(a.model_file, a.function, json.loads(a.json_args), a.micro_batch, a.data, a.seed,
                    json.loads(a.graph) if a.graph else None)
    except Exception as e:  # noqa: BLE001 - the compiler shows this message to the user
        print(f"probe: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    json.dump(out, sys.stdout, sort_keys=True)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
