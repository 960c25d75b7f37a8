"""The reliability report: the figures `make reliability` collects from the long form of the reliability tests
(load, isolation fuzz, timing across tenants, bad inputs, faults, noisy neighbour), one line per check, in
bench/results/reliability.md. Run: `make reliability`."""
import argparse
import json

from prefixcache.models.cpu import cpu_info

LINES = {
    "load": "{clients} concurrent clients, {requests} requests (streaming and not): {errors} errors, outputs equal to "
            "cold: {outputs_equal_cold}; latency p50 {latency_p50_s:.2f} s, p90 {latency_p90_s:.2f} s, p99 "
            "{latency_p99_s:.2f} s; resident memory (MB) after each request of one client: {rss_mb} (it levels "
            "off: oneDNN caches a GEMM primitive per row count seen, up to ONEDNN_PRIMITIVE_CACHE_CAPACITY, 1,024)",
    "isolation fuzz": "{requests} random requests over tenants, labels, salts, cache keys and a shared prefix: "
                      "{cross_scope_hits} cross-scope hits, {hits_checked} hits checked against the oracle, outputs "
                      "equal to cold: {outputs_equal_cold}",
    "timing across tenants": "KS test, {n_per_sample} requests a sample: p = {ks_p_across_tenants:.3g} for another "
                             "tenant's cached prefix vs a fresh one (must be > 0.01); p = {ks_p_own_hit_vs_miss:.3g} "
                             "for a tenant's own hit vs miss (the test's power: must be < 0.01)",
    "bad inputs": "{tried} malformed requests, each answered 4xx in its API's format: {answered_4xx_in_format}",
    "faults": "{injected_step_failures} injected engine-step failures survived: {survived}; blocks leaked "
              "{blocks_leaked}; the request queued behind served: {queued_request_served}",
    "noisy neighbour": "{flooders} clients of one tenant flood unique 1,500-token prompts ({flood_requests} requests; "
                       "{evicted} blocks evicted while measured) while another sends {n} requests on its 1,024-token "
                       "prefix, in {rounds} flooded phases alternating with as many unloaded ones; --shared-chunk "
                       "{shared_chunk}, engine on {engine_threads} thread(s): the prefix stayed cached on every one; "
                       "its TTFT p90 {loaded_p90_s:.3f} s against {quiet_p90_s:.3f} s unloaded: {ratio:.2f}x (target "
                       "<= 1.5x)",
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("figures", help="the JSON the tests wrote (PREFIXCACHE_REPORT)")
    ap.add_argument("--out", default="bench/results/reliability.md")
    args = ap.parse_args()
    with open(args.figures) as f:
        run = json.load(f)
    cpu = cpu_info()
    lines = ["# Reliability", "", f"{cpu.model} ({' '.join(cpu.simd)}), {cpu.threads} threads; the "
             f"{'long' if run['long'] else 'short'} form of the reliability tests, which "
             f"{'passed' if run['passed'] else 'FAILED'}; the tiny random-weight model serves the load checks.", "",
             "| check | result |", "|---|---|"]
    # a check's variants ("noisy neighbour, shared chunk 64") share its line
    lines += [f"| {name} | {LINES[name.split(',')[0]].format(**figures)} |" for name, figures in run["checks"].items()]
    missing = [name for name in LINES if name not in run["checks"]]
    lines += ["", f"Not run: {', '.join(missing)}." if missing else ""]
    with open(args.out, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
