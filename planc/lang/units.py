"""Units of the .plan language: bandwidth (bytes/s), time (s), size (bytes), FLOP rate (FLOP/s)."""

BANDWIDTH = {
    "B/s": 1.0, "KB/s": 1e3, "MB/s": 1e6, "GB/s": 1e9, "TB/s": 1e12,
    "Mb/s": 1e6 / 8, "Gb/s": 1e9 / 8,
}
TIME = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}
SIZE = {"B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12,
        "KiB": 1024, "MiB": 1024**2, "GiB": 1024**3, "TiB": 1024**4}
# device throughput, decimal; `TFLOPS` is accepted as another spelling of `TFLOP/s`
FLOPS = {"FLOP/s": 1.0, "KFLOP/s": 1e3, "MFLOP/s": 1e6, "GFLOP/s": 1e9, "TFLOP/s": 1e12, "PFLOP/s": 1e15}
FLOPS.update({k[:-2] + "S": v for k, v in list(FLOPS.items())})

KINDS = {"bandwidth": BANDWIDTH, "time": TIME, "size": SIZE, "FLOP rate": FLOPS}
_EXAMPLES = {"bandwidth": "'12.5 GB/s'", "time": "'20 us'", "size": "'16 MiB'", "FLOP rate": "'312 TFLOP/s'"}


def parse_quantity(text: str, kind: str) -> float:
    """Parse '12.5 GB/s' (YAML cluster files, pinned values); raises ValueError with a readable message."""
    table = KINDS[kind]
    parts = text.strip().split()
    if len(parts) == 1:
        for unit in sorted(table, key=len, reverse=True):
            if parts[0].endswith(unit) and parts[0][: -len(unit)]:
                parts = [parts[0][: -len(unit)], unit]
                break
    if len(parts) != 2 or parts[1] not in table:
        raise ValueError(f"expected a {kind} such as {_EXAMPLES[kind]}, got {text[:60]!r}")
    try:
        return float(parts[0]) * table[parts[1]]
    except ValueError:
        raise ValueError(f"expected a {kind} such as {_EXAMPLES[kind]}, got {text[:60]!r}") from None
