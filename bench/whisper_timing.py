"""Word timings' numpy steps against transformers 5.25's (the peer, in the same run): dynamic time
warping over tokens x frames (transformers' ``_dynamic_time_warping``: a Python double loop, as
OpenAI's without numba) and the median filter over heads x tokens x frames (transformers'
``_median_filter`` in torch). Prints JSON: seconds (median of repeats) and the peer's time over ours.

    python bench/whisper_timing.py                               # a 30 s window: 1500 frames, 100 tokens, 6 heads
    python bench/whisper_timing.py --tokens 200 --heads 20 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np


def seconds(run: Callable[[], Any], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=100)
    parser.add_argument("--frames", type=int, default=1500)
    parser.add_argument("--heads", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    import torch
    from transformers.models.whisper.generation_whisper import _dynamic_time_warping, _median_filter

    from mlxr_plugins.archs.whisper_timing import dynamic_time_warping, median_filter

    rng = np.random.default_rng(0)
    cost = rng.standard_normal((args.tokens, args.frames))
    weights = rng.standard_normal((args.heads, args.tokens, args.frames))
    assert all(np.array_equal(a, b) for a, b in zip(dynamic_time_warping(cost), _dynamic_time_warping(cost), strict=True))
    ours = {"dtw": seconds(lambda: dynamic_time_warping(cost), args.repeats),
            "median_filter": seconds(lambda: median_filter(weights, 7), args.repeats)}  # fmt: skip
    peer = {"dtw": seconds(lambda: _dynamic_time_warping(cost), args.repeats),
            "median_filter": seconds(lambda: _median_filter(torch.tensor(weights), 7), args.repeats)}  # fmt: skip
    print(json.dumps({
        "shape": {"tokens": args.tokens, "frames": args.frames, "heads": args.heads},
        "mlxr_s": ours, "transformers_s": peer,
        "transformers_over_mlxr": {step: round(peer[step] / ours[step], 2) for step in ours},
    }, indent=2))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
