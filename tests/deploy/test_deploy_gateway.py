"""The replicas behind the Gateway API Inference Extension (deploy/k8s/inference-gateway/). No cluster runs here, so
the custom resources are checked as the API server checks them, against the CRDs of the releases they target
(deploy/k8s/crds/, vendored by its vendor.py): defaults applied, then the OpenAPI schema (unknown fields refused,
as kubectl's strict validation does) and every CEL rule. The checker is shown to refuse what the CRDs refuse. The
endpoint picker's configuration is held to the replicas it serves: pool, ports, block size, events, metrics."""
import copy
import glob
import importlib.util
import os

import celpy
import jsonschema
import pytest
import yaml

from prefixcache.cache.zmq_events import EventsConfig
from prefixcache.cli import build_parser
from prefixcache.config import Config

K8S = os.path.join(os.path.dirname(__file__), "..", "..", "deploy", "k8s")
GATEWAY = sorted(glob.glob(os.path.join(K8S, "inference-gateway", "*.yaml")))
CEL = celpy.Environment()


def documents(path: str) -> list[dict]:
    with open(path) as f:
        return [d for d in yaml.safe_load_all(f) if d is not None]


def crds() -> dict[tuple[str, str], dict]:
    """(apiVersion, kind) -> the openAPIV3Schema of that version."""
    out = {}
    for path in glob.glob(os.path.join(K8S, "crds", "*.yaml")):
        [crd] = documents(path)
        for v in crd["spec"]["versions"]:
            out[(f"{crd['spec']['group']}/{v['name']}", crd["spec"]["names"]["kind"])] = v["schema"]["openAPIV3Schema"]
    return out


def json_schema(node: dict) -> dict:
    """A structural schema as JSON Schema: nullable as a null type, int-or-string as either, and no fields beyond
    the declared properties unless the schema preserves unknown ones."""
    out = {k: v for k, v in node.items() if not k.startswith("x-kubernetes-") and k not in ("nullable", "default")}
    if node.get("nullable") and "type" in out:
        out["type"] = [out["type"], "null"]
    if node.get("x-kubernetes-int-or-string"):
        out.pop("type", None)
        out.setdefault("anyOf", [{"type": "integer"}, {"type": "string"}])
    if "properties" in node:
        out["properties"] = {k: json_schema(v) for k, v in node["properties"].items()}
        if not node.get("x-kubernetes-preserve-unknown-fields") and "additionalProperties" not in node:
            out["additionalProperties"] = False
    if isinstance(node.get("additionalProperties"), dict):
        out["additionalProperties"] = json_schema(node["additionalProperties"])
    if "items" in node:
        out["items"] = json_schema(node["items"])
    for k in ("anyOf", "oneOf", "allOf"):
        if k in node:
            out[k] = [json_schema(s) for s in node[k]]
    return out


def defaulted(value, node: dict):
    """The object with the schema's defaults filled in, as the API server stores it before validating."""
    if isinstance(value, dict) and "properties" in node:
        value = {**{k: copy.deepcopy(s["default"]) for k, s in node["properties"].items()
                    if "default" in s and k not in value}, **value}
        return {k: defaulted(v, node["properties"].get(k, {})) for k, v in value.items()}
    if isinstance(value, dict) and isinstance(node.get("additionalProperties"), dict):
        return {k: defaulted(v, node["additionalProperties"]) for k, v in value.items()}
    if isinstance(value, list) and "items" in node:
        return [defaulted(v, node["items"]) for v in value]
    return value


def rule_failures(value, node: dict, path: str) -> list[str]:
    """Every x-kubernetes-validations rule that fails on `value` or below (transition rules, which need the old
    object, are for updates only)."""
    failed = []
    for rule in node.get("x-kubernetes-validations", []):
        if "oldSelf" in rule["rule"]:
            continue
        result = CEL.program(CEL.compile(rule["rule"])).evaluate({"self": celpy.json_to_cel(value)})
        assert not isinstance(result, celpy.CELEvalError), f"{path}: {rule['rule']} did not evaluate: {result}"
        if not result:
            failed.append(f"{path}: {rule.get('message', rule['rule'])}")
    if isinstance(value, dict):
        for k, v in value.items():
            sub = node.get("properties", {}).get(k)
            if sub is None and isinstance(node.get("additionalProperties"), dict):
                sub = node["additionalProperties"]
            failed += rule_failures(v, sub, f"{path}.{k}") if sub else []
    elif isinstance(value, list) and "items" in node:
        for i, v in enumerate(value):
            failed += rule_failures(v, node["items"], f"{path}[{i}]")
    return failed


def problems(obj: dict) -> list[str]:
    """What the API server would refuse in this custom resource (empty: it is accepted)."""
    schema = crds()[(obj["apiVersion"], obj["kind"])]
    obj = defaulted(obj, schema)
    errors = [f"{'.'.join(map(str, e.absolute_path))}: {e.message}"
              for e in jsonschema.Draft7Validator(json_schema(schema)).iter_errors(obj)]
    return errors or rule_failures(obj, schema, obj["kind"])


def objects() -> dict[str, dict[str, dict]]:
    """kind -> name -> object over the gateway's manifests and the replicas'."""
    by_kind: dict[str, dict[str, dict]] = {}
    for d in (d for path in [*GATEWAY, os.path.join(K8S, "replicas.yaml")] for d in documents(path)):
        by_kind.setdefault(d["kind"], {})[d["metadata"]["name"]] = d
    return by_kind


def serve_args():
    [replicas] = objects()["StatefulSet"].values()
    [container] = replicas["spec"]["template"]["spec"]["containers"]
    return replicas, container, build_parser().parse_args(container["command"][1:])


def flags(args: list[str]) -> dict[str, str]:
    return {a: b for a, b in zip(args, args[1:]) if a.startswith("--") and not b.startswith("--")}


def test_every_custom_resource_is_what_its_crd_accepts():
    known = crds()
    custom = [d for path in GATEWAY for d in documents(path) if (d["apiVersion"], d["kind"]) in known]
    assert {d["kind"] for d in custom} == {"InferencePool", "Gateway", "HTTPRoute"}
    for d in custom:
        assert problems(d) == [], d["metadata"]["name"]
    builtin = {"v1", "apps/v1", "rbac.authorization.k8s.io/v1", "networking.k8s.io/v1"}
    for d in (d for path in GATEWAY for d in documents(path)):  # nothing of a kind no CRD here describes
        assert d["apiVersion"] in builtin or (d["apiVersion"], d["kind"]) in known, d["kind"]


@pytest.mark.parametrize("kind, change, refusal", [
    ("InferencePool", lambda s: s.pop("targetPorts"), "'targetPorts' is a required property"),
    ("InferencePool", lambda s: s["targetPorts"].append({"number": 8000}), "port number must be unique"),
    ("InferencePool", lambda s: s["endpointPickerRef"].pop("port"), "port is required when kind is 'Service'"),
    ("InferencePool", lambda s: s.update(appProtocol="grpc"), "is not one of"),
    ("InferencePool", lambda s: s.update(targetPort=[{"number": 1}]), "Additional properties are not allowed"),
    ("Gateway", lambda s: s["listeners"][0].update(port=70000), "is greater than the maximum of 65535"),
    ("Gateway", lambda s: s["listeners"][0].update(protocol="HTTP/2!"), "does not match"),
    ("Gateway", lambda s: s["listeners"].append(dict(s["listeners"][0])), "Listener name must be unique"),
    ("HTTPRoute", lambda s: s["rules"][0]["matches"][0]["path"].update(value="api"),
     "value must be an absolute path and start with '/'"),
    ("HTTPRoute", lambda s: s["rules"][0]["timeouts"].update(backendRequest="600s"),
     "backendRequest timeout cannot be longer than request timeout"),
])
def test_the_check_refuses_what_the_crds_refuse(kind, change, refusal):
    [obj] = copy.deepcopy(list(objects()[kind].values()))
    change(obj["spec"])
    found = problems(obj)
    assert any(refusal in p for p in found), found


def test_the_pool_the_picker_and_the_replicas_agree():
    o = objects()
    replicas, container, args = serve_args()
    [pool] = o["InferencePool"].values()
    pod_labels = replicas["spec"]["template"]["metadata"]["labels"]
    assert pool["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert [p["number"] for p in pool["spec"]["targetPorts"]] == [args.port]

    picker_service = o["Service"][pool["spec"]["endpointPickerRef"]["name"]]
    [picker] = [d for d in o["Deployment"].values() if picker_service["spec"]["selector"].items() <=
                d["spec"]["template"]["metadata"]["labels"].items()]
    [epp] = picker["spec"]["template"]["spec"]["containers"]
    opts = flags(epp["args"])
    assert [p["port"] for p in picker_service["spec"]["ports"]] == [pool["spec"]["endpointPickerRef"]["port"]["number"]]
    assert opts["--grpc-port"] == str(picker_service["spec"]["ports"][0]["targetPort"])
    assert opts["--pool-name"] == pool["metadata"]["name"] and opts["--pool-group"] == "inference.networking.k8s.io"
    assert int(opts["--model-server-metrics-port"]) == args.metrics_port  # the port that needs no key
    assert picker["spec"]["template"]["spec"]["serviceAccountName"] in {
        s["name"] for b in o["RoleBinding"].values() for s in b["subjects"]}

    [route] = o["HTTPRoute"].values()
    assert [r["name"] for r in route["spec"]["parentRefs"]] == list(o["Gateway"])
    assert [(b["kind"], b["name"]) for rule in route["spec"]["rules"] for b in rule["backendRefs"]] == [
        ("InferencePool", pool["metadata"]["name"])]


def test_the_pickers_config_follows_the_replicas_events_and_metrics():
    o = objects()
    _, container, args = serve_args()
    [picker] = [d for d in o["Deployment"].values() if d["metadata"]["name"] == "prefixcache-epp"]
    [epp] = picker["spec"]["template"]["spec"]["containers"]
    config_path = flags(epp["args"])["--config-file"]
    [mount] = [m for m in epp["volumeMounts"] if config_path.startswith(m["mountPath"] + "/")]
    [volume] = [v for v in picker["spec"]["template"]["spec"]["volumes"] if v["name"] == mount["name"]]
    config = yaml.safe_load(o["ConfigMap"][volume["configMap"]["name"]]["data"][os.path.basename(config_path)])
    assert config["kind"] == "EndpointPickerConfig"

    plugins = {p.get("name", p["type"]): p for p in config["plugins"]}
    refs = [r["pluginRef"] for prof in config["schedulingProfiles"] for r in prof["plugins"]]
    refs += [r["pluginRef"] for s in config["dataLayer"]["sources"] for r in [s, *s["extractors"]]]
    assert set(refs) <= set(plugins)  # every reference names a declared plugin

    events = EventsConfig.parse(args.kv_events_config.replace("$(POD_IP)", "10.0.0.7"))
    scorer = plugins["precise-prefix-cache-scorer"]["parameters"]
    assert events.enable_kv_cache_events and events.publisher == "zmq" and events.include_token_ids
    assert scorer["tokenProcessorConfig"]["blockSize"] == (args.block_size or Config.block_size)
    discovery = scorer["kvEventsConfig"]["podDiscoveryConfig"]
    assert events.endpoint == f"tcp://*:{discovery['socketPort']}"  # the picker connects to each pod's socket
    assert events.topic.startswith(scorer["kvEventsConfig"]["topicFilter"])
    key, value = discovery["podLabelSelector"].split("=")
    assert o["StatefulSet"]["prefixcache-replica"]["spec"]["template"]["metadata"]["labels"][key] == value
    assert "POD_IP" in {e["name"] for e in container["env"]}  # the topic names the pod
    ports = {p["containerPort"] for p in container["ports"]}
    assert {args.port, args.metrics_port, discovery["socketPort"]} <= ports


def test_only_the_picker_and_prometheus_reach_the_metrics_port_and_the_events():
    _, _, args = serve_args()
    policy = objects()["NetworkPolicy"]["prefixcache-replica"]
    by_port = {p["port"]: rule.get("from") for rule in policy["spec"]["ingress"] for p in rule["ports"]}
    assert by_port[args.port] is None  # the API: anyone (keys decide the tenant)
    picker = {"podSelector": {"matchLabels": {"app": "prefixcache-epp"}}}
    events_port = int(EventsConfig.parse(args.kv_events_config).endpoint.rsplit(":", 1)[1])
    assert by_port[events_port] == [picker]
    assert picker in by_port[args.metrics_port] and len(by_port[args.metrics_port]) == 2


def test_the_vendored_crds_are_the_pinned_releases():
    """vendor.py's pins and the files agree: each CRD is of the release its URL names."""
    spec = importlib.util.spec_from_file_location("vendor", os.path.join(K8S, "crds", "vendor.py"))
    vendor = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(vendor)
    for source in vendor.SOURCES:
        group, plural = os.path.basename(source).removesuffix(".yaml").split("_")
        [crd] = documents(os.path.join(K8S, "crds", f"{plural}.{group}.yaml"))
        release = source.split("/")[5]  # https://raw.githubusercontent.com/OWNER/REPO/TAG/...
        assert crd["metadata"]["annotations"][f"{group}/bundle-version"] == release, plural
