"""`prefixcache doctor`: this CPU, what the exactness probe found, the mode chosen, and what exactness costs."""
import os


def run(args) -> None:
    from prefixcache.config import Config
    from prefixcache.engine.engine import Engine
    from prefixcache.models.cpu import cpu_info
    from prefixcache.models.exactness import KEY_STEP
    from prefixcache.models.timer import step_ms
    from prefixcache.options import resolve

    engine = Engine(Config(**resolve(args)[0]))
    cpu, plan, model = cpu_info(), engine.exactness, engine.runner.model
    print(f"cpu      {cpu.model}\nsimd     {' '.join(cpu.simd) or 'none'}\n"
          f"threads  {cpu.threads}\nopenmp   {_wait()}\ntorch    {cpu.torch} ({cpu.blas})\n"
          f"model    {engine.model_name} ({engine.config.dtype}, KV {engine.config.kv_storage_dtype})\n"
          f"kernels  {plan.kernels}")
    print(f"probe    {'cached' if plan.cached else 'ran'}, {plan.probe_seconds:.2f} s; row counts whose every row "
          "equals a reference call's:")
    for c in plan.ops:
        print(f"  {c.name:20} {c.shape:12} agree {_ranges(c.agree) or '-'}; differ {_ranges(c.differ) or '-'}")
    if plan.mode == "kernel":
        print("mode     kernel: row-wise calls of any row count, unpadded; paged attention, one call per layer"
              f"\nnote     {plan.note}")
    else:
        rows = {"pad": f"calls under {plan.m0} rows padded to {_ranges(plan.row_sizes)} rows",
                "fixed": f"every call in chunks of {plan.m0} rows", "rows": "one row per call"}[plan.mode]
        keys = [*plan.key_lengths, model.tile]
        print(f"mode     {plan.mode}: {rows}; attention calls of {_ranges(plan.attn_sizes)} query rows over "
              f"{_ranges(keys, KEY_STEP)} keys (a tile's keys padded to the next)\nnote     {plan.note}")
    for b in (1, 8):
        bare, run = step_ms(model, b), step_ms(model, b, plan)
        print(f"cost     b={b}: one decode step's GEMMs, norms and SwiGLU {bare:.1f} ms unpadded, {run:.1f} ms as "
              f"run ({plan.call_rows(b)} rows per call): x{run / bare:.2f}")


def _wait() -> str:
    """How OpenMP's threads wait for work, from the settings libgomp read when torch loaded (prefixcache/__init__.py
    sets them unless they were set, or torch was imported first)."""
    policy, spin = os.environ.get("OMP_WAIT_POLICY", "").upper(), os.environ.get("GOMP_SPINCOUNT")
    wait = f"spin {spin} pauses, then sleep" if spin else {"PASSIVE": "sleep at once", "ACTIVE": "spin"}.get(
        policy, "spin 300,000 pauses (libgomp's default), then sleep")
    return f"waiting threads {wait} (OMP_WAIT_POLICY={policy or 'unset'}, GOMP_SPINCOUNT={spin or 'unset'})"


def _ranges(values: list[int], step: int = 1) -> str:
    """[1, 2, 3, 5, 8, 9] -> "1-3, 5, 8-9"; with step 16, [16, 32, 48, 80] -> "16-48, 80"."""
    runs = []
    for v in values:
        if runs and v == runs[-1][1] + step:
            runs[-1][1] = v
        else:
            runs.append([v, v])
    return ", ".join(f"{a}-{b}" if b > a else str(a) for a, b in runs)
