"""planc's lab, outside the product (not in the wheel): it imports planc, planc never imports it.

    bench/       the benchmarks whose tables go into docs/benchmarks.md (``python -m benchmarks bench WHAT``)
    testbed/     the emulated cluster: network namespaces, veth, a bridge, ``tc`` shaping (docs/testbed.md)
    calibrate.py ``planc calibrate`` on the testbed (``python -m benchmarks calibrate --on testbed``)
    cli.py       ``python -m benchmarks``: bench | testbed | calibrate
"""
