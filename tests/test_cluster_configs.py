"""Every file in `cluster_configs/` is checked by its kind, found by glob (a new file is covered at once).

Kinds: a Ray cluster-launcher config (validated by Ray's own `prepare_config` + `validate_config`,
the schema `ray up` applies before it contacts a cloud), a KubeRay manifest (checked structurally),
or a dloco RunConfig (loaded with `dloco.config.load`). A file of no known kind fails. Each
RunConfig's learner groups must fit on one node type of its paired cluster definition: ``X.yaml``
for ``X.run.yaml``, the KubeRay manifest whose entrypoint names it, or a script under `scripts/`
that names it; a RunConfig without one is a single-machine config and asks for no custom resource.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import re
import shlex
from pathlib import Path

import pytest
import yaml

from dloco import config

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "cluster_configs"
FILES = sorted(p for p in CONFIGS.iterdir() if p.is_file())
RUN_KEYS = {f.name for f in dataclasses.fields(config.RunConfig)}
AUTH = "RAY_AUTH_MODE=token"
PRIVATE_PORTS = (6379, 8265, 10001)  # GCS, dashboard / job server, Ray client


def docs(path: Path) -> list:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def kind(path: Path) -> str:
    if path.suffix not in (".yaml", ".yml"):
        return "unknown"
    try:
        ds = docs(path)
    except yaml.YAMLError:
        return "unknown"
    if any(isinstance(d, dict) and str(d.get("apiVersion", "")).startswith("ray.io/") for d in ds):
        return "kuberay"
    if len(ds) != 1 or not isinstance(ds[0], dict):
        return "unknown"
    if "provider" in ds[0] and "cluster_name" in ds[0]:
        return "launcher"
    if set(ds[0]) <= RUN_KEYS:
        return "runconfig"
    return "unknown"


def of_kind(k: str) -> list[Path]:
    return [p for p in FILES if kind(p) == k]


def ids(paths):
    return [p.name for p in paths]


def test_the_glob_finds_every_kind():
    assert {"launcher", "kuberay", "runconfig"} <= {kind(p) for p in FILES}
    assert len(of_kind("launcher")) >= 2


@pytest.mark.parametrize("path", FILES, ids=ids(FILES))
def test_every_file_is_of_a_known_kind(path):
    assert kind(path) != "unknown", (
        f"{path.name} is neither a Ray launcher config (provider, cluster_name), a KubeRay manifest "
        f"(apiVersion ray.io/...), nor a RunConfig (keys from {sorted(RUN_KEYS)}); add a check for it"
    )


# ---- Ray cluster-launcher configs ---------------------------------------------------------------
@pytest.mark.parametrize("path", of_kind("launcher"), ids=ids(of_kind("launcher")))
def test_launcher_config_passes_rays_validation(path):
    from ray.autoscaler._private.util import prepare_config, validate_config

    raw = docs(path)[0]
    prepared = prepare_config(copy.deepcopy(raw))  # merges the provider's defaults.yaml, as `ray up` does
    validate_config(prepared)  # ray-schema.json + head/worker consistency; raises on any error
    assert raw["head_node_type"] in raw["available_node_types"]
    assert (CONFIGS / path.name.replace(".yaml", ".run.yaml")).is_file(), "a launcher config needs X.run.yaml"


@pytest.mark.parametrize("path", of_kind("launcher"), ids=ids(of_kind("launcher")))
def test_launcher_config_is_locked_down(path):
    raw = docs(path)[0]
    starts = [*raw["head_start_ray_commands"], *raw["worker_start_ray_commands"]]
    for cmd in starts:
        assert AUTH in cmd, f"every Ray command needs {AUTH}: {cmd!r}"
    head = " ".join(raw["head_start_ray_commands"])
    assert "--dashboard-host=127.0.0.1" in head and "0.0.0.0" not in head
    assert "auth_token" in " ".join(raw["setup_commands"]), "the token must reach every node"
    for rule in (raw["provider"].get("security_group") or {}).get("IpPermissions", []):
        public = any(r.get("CidrIp") == "0.0.0.0/0" for r in rule.get("IpRanges", []))
        lo, hi = rule.get("FromPort", -1), rule.get("ToPort", -1)
        opens = any(lo == -1 or lo <= port <= hi for port in PRIVATE_PORTS)
        assert not (public and opens), f"{rule} opens a Ray port to the internet"
    text = path.read_text()
    for var in ("RAY_USE_TLS", "RAY_TLS_SERVER_CERT", "RAY_TLS_SERVER_KEY", "RAY_TLS_CA_CERT"):
        assert var in text, f"describe TLS ({var})"


@pytest.mark.parametrize("path", of_kind("launcher"), ids=ids(of_kind("launcher")))
def test_tpu_node_types_name_valid_accelerators(path):
    tpu = pytest.importorskip("ray._private.accelerators").TPUAcceleratorManager
    for name, nt in docs(path)[0]["available_node_types"].items():
        acc = nt["node_config"].get("acceleratorType")
        if acc is not None:  # the check Ray's GCP provider makes (`_validate_tpu_config`)
            assert tpu.is_valid_tpu_accelerator_type(acc), f"{name}: acceleratorType {acc!r}"


# ---- KubeRay manifests --------------------------------------------------------------------------
def rayjob(path: Path) -> dict:
    return next(d for d in docs(path) if str(d.get("apiVersion", "")).startswith("ray.io/"))


def entrypoint_config(job: dict) -> Path:
    words = shlex.split(job["spec"]["entrypoint"])
    assert "dloco" in words and "train" in words and "--config" in words, job["spec"]["entrypoint"]
    return ROOT / words[words.index("--config") + 1]


def pod_templates(job: dict) -> list[dict]:
    spec = job["spec"]["rayClusterSpec"]
    out = [spec["headGroupSpec"]["template"], *(g["template"] for g in spec["workerGroupSpecs"])]
    return out + ([job["spec"]["submitterPodTemplate"]] if "submitterPodTemplate" in job["spec"] else [])


@pytest.mark.parametrize("path", of_kind("kuberay"), ids=ids(of_kind("kuberay")))
def test_kuberay_manifest(path):
    job = rayjob(path)
    assert job["apiVersion"] == "ray.io/v1" and job["kind"] == "RayJob"
    cfg = entrypoint_config(job)
    assert cfg.is_file() and kind(cfg) == "runconfig", f"the entrypoint's --config {cfg} is not a RunConfig here"
    spec = job["spec"]["rayClusterSpec"]
    assert spec["headGroupSpec"].get("serviceType", "ClusterIP") == "ClusterIP"
    for d in docs(path):
        assert d.get("kind") != "Ingress"
        if d.get("kind") == "Service":
            assert d.get("spec", {}).get("type", "ClusterIP") == "ClusterIP"
    parsed = json.dumps(docs(path))  # comments may name these words; the manifest itself may not use them
    for word in ("hostPort", "hostNetwork", "LoadBalancer", "NodePort"):
        assert word not in parsed, f"{path.name} exposes a port with {word}"
    assert spec.get("authOptions", {}).get("mode") == "token"
    for tpl in pod_templates(job):
        for c in tpl["spec"]["containers"]:
            env = {e["name"]: e.get("value") for e in c.get("env", [])}
            assert env.get("RAY_AUTH_MODE") == "token", f"container {c['name']} needs {AUTH}"
    for g in spec["workerGroupSpecs"]:
        labels = g["template"].get("metadata", {}).get("labels", {})
        assert "dloco/region" in labels, f"worker group {g['groupName']} is not labelled by region"
        assert any(k.startswith("region_") for k in kuberay_resources(g)), g["groupName"]


def kuberay_resources(group: dict) -> dict[str, float]:
    params = group.get("rayStartParams", {})
    res = {k: float(v) for k, v in json.loads(json.loads(params["resources"])).items()} if "resources" in params else {}
    limits = group["template"]["spec"]["containers"][0].get("resources", {}).get("limits", {})
    res["CPU"] = float(params.get("num-cpus", limits.get("cpu", 0)))
    res["GPU"] = float(params.get("num-gpus", limits.get("nvidia.com/gpu", 0)))
    return res


# ---- RunConfigs and their clusters --------------------------------------------------------------
@pytest.mark.parametrize("path", of_kind("runconfig"), ids=ids(of_kind("runconfig")))
def test_run_config_loads(path):
    cfg = config.load(path)
    assert cfg.learners.count >= 1


def cluster_nodes(run_path: Path) -> tuple[str, list[dict[str, float]]] | None:
    """(where, resources of each node type) of the cluster definition paired with `run_path`."""
    if run_path.name.endswith(".run.yaml"):
        launcher = run_path.with_name(run_path.name.replace(".run.yaml", ".yaml"))
        if launcher.is_file() and kind(launcher) == "launcher":
            types = docs(launcher)[0]["available_node_types"]
            return launcher.name, [{k: float(v) for k, v in nt["resources"].items()} for nt in types.values()]
    for manifest in of_kind("kuberay"):
        job = rayjob(manifest)
        if entrypoint_config(job).resolve() == run_path.resolve():
            groups = job["spec"]["rayClusterSpec"]["workerGroupSpecs"]
            return manifest.name, [kuberay_resources(g) for g in groups]
    rel = run_path.relative_to(ROOT).as_posix()
    for script in sorted((ROOT / "scripts").glob("*.sh")):
        text = script.read_text()
        if rel in text:
            nodes = []
            for m in re.finditer(r"--num-cpus=(\d+(?:\.\d+)?)\s+--resources='([^']+)'", text):
                nodes.append({"CPU": float(m.group(1)), **{k: float(v) for k, v in json.loads(m.group(2)).items()}})
            assert nodes, f"{script.name} names {rel} but starts no node with --num-cpus and --resources"
            return script.name, nodes
    return None


@pytest.mark.parametrize("path", of_kind("runconfig"), ids=ids(of_kind("runconfig")))
def test_learner_groups_fit_a_node_type_of_their_cluster(path):
    cfg = config.load(path)
    groups = cfg.learners.groups or (
        config.LearnerGroup(
            "default", cfg.learners.count, 0, cfg.learners.num_cpus, cfg.learners.num_gpus, cfg.learners.resources
        ),
    )
    paired = cluster_nodes(path)
    if paired is None:  # a single-machine config: `dloco train` starts a local cluster without custom resources
        assert all(not g.resources for g in groups), f"{path.name} asks for custom resources but has no cluster file"
        return
    where, nodes = paired
    for g in groups:
        need = {**dict(g.resources), "CPU": g.num_cpus, "GPU": g.num_gpus}
        need = {k: v for k, v in need.items() if v > 0}
        fits = [n for n in nodes if all(n.get(k, 0.0) >= v for k, v in need.items())]
        assert fits, f"{path.name}: group {g.name} needs {need}; no node type of {where} has it: {nodes}"


# ---- preemptible capacity -----------------------------------------------------------------------
def _spot(node_config: dict) -> bool:
    """Whether a launcher node type asks for spot / preemptible capacity (AWS, GCP VM, GCP TPU VM)."""
    market = node_config.get("InstanceMarketOptions", {}).get("MarketType")
    sched = node_config.get("scheduling") or {}
    tpu = node_config.get("schedulingConfig") or {}
    return (
        market == "spot" or sched.get("provisioningModel") == "SPOT" or bool(tpu.get("spot") or tpu.get("preemptible"))
    )


@pytest.mark.parametrize("path", of_kind("launcher"), ids=ids(of_kind("launcher")))
def test_learners_run_on_spot_capacity_and_the_head_on_demand(path):
    """The product is for preemptible fleets: every node type the launcher starts for learners is
    spot or preemptible; the head (driver, store, syncer) is not. Node types with max_workers 0 are
    joined by hand (docs/CLUSTER.md shows their spot flags)."""
    (c,) = docs(path)
    types = c["available_node_types"]
    assert not _spot(types[c["head_node_type"]]["node_config"]), f"{path.name}: the head must be on-demand"
    managed = [n for n, t in types.items() if n != c["head_node_type"] and t.get("max_workers", 0) > 0]
    assert managed and all(_spot(types[n]["node_config"]) for n in managed), managed


def test_kuberay_learners_on_a_spot_node_pool_and_a_defined_run_volume():
    (path,) = of_kind("kuberay")
    job = rayjob(path)
    spec = job["spec"]["rayClusterSpec"]
    assert "cloud.google.com/gke-spot" not in spec["headGroupSpec"]["template"]["spec"].get("nodeSelector", {})
    for g in spec["workerGroupSpecs"]:
        pod = g["template"]["spec"]
        assert pod["nodeSelector"]["cloud.google.com/gke-spot"] == "true", g["groupName"]
        assert any(t["key"] == "cloud.google.com/gke-spot" for t in pod["tolerations"]), g["groupName"]
        assert 0 < config.load().learners.drain_s < pod["terminationGracePeriodSeconds"], g["groupName"]
    claims = {d["metadata"]["name"]: d for d in docs(path) if d.get("kind") == "PersistentVolumeClaim"}
    assert claims["dloco-runs"]["spec"]["accessModes"] == ["ReadWriteMany"]  # the claim the pods mount
    assert "/mnt/runs/" in job["spec"]["entrypoint"]


def test_the_run_configs_drain_within_their_clouds_notice():
    notice = {"aws_gpu_multiregion.run.yaml": 120, "gcp_tpu_multiregion.run.yaml": 30, "kuberay_rayjob.run.yaml": 30}
    for name, seconds in notice.items():
        assert 0 < config.load(CONFIGS / name).learners.drain_s < seconds, name


def test_the_cloud_run_configs_carry_a_store_mirror_on_their_clouds_bucket(tmp_path):
    """The commented `store: {mirror: …}` line, uncommented, loads with the cloud's own scheme."""
    for name, scheme in {"aws_gpu_multiregion.run.yaml": "s3://", "gcp_tpu_multiregion.run.yaml": "gs://"}.items():
        text = (CONFIGS / name).read_text()
        line = next(x for x in text.splitlines() if x.startswith("# store: {mirror: "))
        (tmp_path / name).write_text(text.replace(line, line[2:]))
        assert config.load(tmp_path / name).store.mirror.startswith(scheme), name
