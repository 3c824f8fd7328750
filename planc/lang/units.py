"""Units of the .plan language: bandwidth (bytes/s), time (s), size (bytes)."""

BANDWIDTH = {
    "B/s": 1.0, "KB/s": 1e3, "MB/s": 1e6, "GB/s": 1e9, "TB/s": 1e12,
    "Mb/s": 1e6 / 8, "Gb/s": 1e9 / 8,
}
TIME = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}
SIZE = {"B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "KiB": 1024, "MiB": 1024**2, "GiB": 1024**3}

KINDS = {"bandwidth": BANDWIDTH, "time": TIME, "size": SIZE}


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
        raise ValueError(f"expected a {kind} such as " + {"bandwidth": "'12.5 GB/s'", "time": "'20 us'", "size": "'16 MiB'"}[kind] + f", got {text!r}")
    return float(parts[0]) * table[parts[1]]
