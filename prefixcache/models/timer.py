"""The cost of an exactness plan (models/exactness.py): one engine step's row-wise ops timed as the plan runs them,
for `prefixcache doctor`."""
import statistics
import time

import torch

from prefixcache.models.exactness import Exactness, in_calls


def step_ms(model, rows: int, plan: Exactness | None = None, repeats: int = 5) -> float:
    """Median time of one engine step's row-wise ops (every layer's, then the head) on `rows` rows: as the plan
    runs them, or unpadded without one."""
    layers = [model.row_ops(i) for i in range(model.config.num_layers)]
    ops = [op for i, layer in enumerate(layers) for op in layer if i == 0 or not op.head]
    size = plan.call_rows(rows) if plan else rows
    widths = {op.name: op.width for op in ops}  # of one name, one width (a layer's MLP may be dense or not)
    xs = {name: torch.randn(rows, width).to(model.norm.dtype) for name, width in widths.items()}
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for op in ops:
            in_calls(op.fn, xs[op.name], size, *op.args)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3
