"""trn_accum.eks: the EKS manifests validate offline (kubernetes-validate --strict), say what
the design needs, and give each pod the environment trn_accum.distributed derives a job from."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from trn_accum.cluster import rootport
from trn_accum.cluster.distributed import derive_launch
from trn_accum.cluster.eks import RenderError, manifests, render_eks

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "launch" / "eks" / "fuji-3b-trn2-4nodes.yaml"
EXAMPLE_IMAGE = "123456789012.dkr.ecr.us-west-2.amazonaws.com/trn-accum:neuron"
EXAMPLE_ARGS = ("--set", "trainer.accum_steps=16")
IMAGE = "registry.example.com/trn-accum:neuron"


def validator() -> str:
    exe = Path(sys.executable).parent / "kubernetes-validate"
    found = str(exe) if exe.exists() else shutil.which("kubernetes-validate")
    assert found, "kubernetes-validate is missing: pip install -e '.[test]'"
    return found


def validate(*files: Path, version: str | None = None) -> subprocess.CompletedProcess:
    cmd = [validator(), "--strict", "--quiet"]
    if version:
        cmd += ["-k", version]
    return subprocess.run([*cmd, *map(str, files)], capture_output=True, text=True, check=False)


def by_kind(docs):
    return {d["kind"]: d for d in docs}


@pytest.mark.parametrize("version", [None, "1.29.0"])  # newest bundled schema; EKS 1.29
def test_manifests_pass_kubernetes_validate_strict(tmp_path, version):
    files = [EXAMPLE, REPO / "launch" / "eks" / "fsx-pvc.yaml"]
    for n in (1, 2, 16):
        f = tmp_path / f"n{n}.yaml"
        f.write_text(render_eks(n, IMAGE))
        files.append(f)
    out = validate(*files, version=version)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "Couldn't find schema" not in out.stdout + out.stderr  # really validated


def test_validation_is_strict(tmp_path):
    """A misspelt field fails: the check above can fail."""
    bad = render_eks(2, IMAGE).replace("backoffLimit:", "backofLimit:")
    f = tmp_path / "bad.yaml"
    f.write_text(bad)
    assert validate(f).returncode != 0


def test_checked_in_example_is_current():
    text = render_eks(4, EXAMPLE_IMAGE, train_args=EXAMPLE_ARGS)
    assert EXAMPLE.read_text() == text, (
        "launch/eks/fuji-3b-trn2-4nodes.yaml is stale: regenerate it with the command in its header"
    )


@pytest.mark.parametrize("nodes", [1, 2, 4, 16])
def test_yaml_round_trips_to_the_manifests(nodes):
    docs = list(yaml.safe_load_all(render_eks(nodes, IMAGE, train_args=EXAMPLE_ARGS)))
    assert docs == manifests(nodes, IMAGE, train_args=EXAMPLE_ARGS)


@pytest.mark.parametrize("nodes", [2, 16])
def test_job_shape(nodes):
    d = by_kind(yaml.safe_load_all(render_eks(nodes, IMAGE)))
    svc, job = d["Service"], d["Job"]
    assert svc["spec"]["clusterIP"] == "None"
    assert svc["spec"]["publishNotReadyAddresses"] is True
    spec = job["spec"]
    pod = spec["template"]["spec"]
    labels = spec["template"]["metadata"]["labels"]
    assert all(labels[k] == v for k, v in svc["spec"]["selector"].items())
    assert pod["subdomain"] == svc["metadata"]["name"]
    assert (spec["completionMode"], spec["completions"], spec["parallelism"]) == (
        "Indexed",
        nodes,
        nodes,
    )
    assert pod["restartPolicy"] == "Never"
    # every restart fails all `nodes` pods: backoffLimit allows 3 whole-job restarts
    assert spec["backoffLimit"] == 3 * nodes
    assert spec["podReplacementPolicy"] == "Failed"  # never two pods for one rank
    rules = spec["podFailurePolicy"]["rules"]
    assert [(r["action"], r.get("onExitCodes", {}).get("values")) for r in rules] == [
        ("FailJob", [2]),  # user error: retrying cannot help
        ("Ignore", [75]),  # preempted after a clean save: restart, do not count
        ("Ignore", None),
    ]
    assert rules[2]["onPodConditions"] == [{"type": "DisruptionTarget", "status": "True"}]
    assert pod["nodeSelector"] == {"node.kubernetes.io/instance-type": "trn2.48xlarge"}
    (c,) = pod["containers"]
    want = {"aws.amazon.com/neuron": 16, "vpc.amazonaws.com/efa": 16}
    assert c["resources"] == {"requests": want, "limits": want}
    vols = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    assert vols["dshm"]["emptyDir"]["medium"] == "Memory" and mounts["dshm"] == "/dev/shm"
    assert vols["checkpoints"]["persistentVolumeClaim"]["claimName"] == "trn-accum-fsx"
    assert mounts["checkpoints"] == "/checkpoints"
    assert pod["terminationGracePeriodSeconds"] >= 120  # time to save on SIGTERM
    script = c["command"][-1]
    assert "source launch/env/trn2.sh" in script
    assert (
        "exec trn-accum train --config configs/fuji-3b-trn2.toml --run-dir /checkpoints/fuji-3b"
        in script
    )


@pytest.mark.parametrize("nodes", [1, 2, 16])
def test_pod_environment_gives_the_launch_plan(nodes):
    """Each pod's env (+ JOB_COMPLETION_INDEX, set by Kubernetes) -> trn_accum.distributed."""
    job = by_kind(manifests(nodes, IMAGE, name="fuji", namespace="ml"))["Job"]
    (c,) = job["spec"]["template"]["spec"]["containers"]
    base = {e["name"]: e["value"] for e in c["env"]}
    dns = {"fuji-0.fuji": "10.0.3.1"}  # rank 0's pod, as the cluster DNS resolves it
    for index in range(nodes):
        env = {**base, "JOB_COMPLETION_INDEX": str(index)}
        plan = derive_launch(env, neuron=True, resolve=dns.__getitem__)
        assert (plan.num_processes, plan.process_id) == (nodes, 0 if nodes == 1 else index)
        if nodes == 1:
            assert plan.mode == "single"
            continue
        assert plan.mode == "kubernetes"
        assert plan.coordinator == "fuji-0.fuji:55527"  # <job>-0.<subdomain>:<port>
        assert plan.hosts[index] == f"fuji-{index}.fuji"
        assert plan.neuron_env["NEURON_RT_ROOT_COMM_ID"] == "10.0.3.1:41000"  # <ip>:<port>
        assert plan.neuron_env["NEURON_PJRT_PROCESSES_NUM_DEVICES"] == ",".join(["64"] * nodes)
        assert plan.neuron_env["NEURON_PJRT_PROCESS_INDEX"] == str(index)
    svc = by_kind(manifests(nodes, IMAGE, name="fuji", namespace="ml"))["Service"]
    ports = {p["name"]: p["port"] for p in svc["spec"]["ports"]}
    assert ports == {"coordinator": 55527, "neuron-root": 41000}


def test_pods_reserve_their_listening_ports_and_name_the_socket_interface():
    job = by_kind(manifests(2, IMAGE))["Job"]
    pod = job["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    sysctls = {x["name"]: x["value"] for x in pod["securityContext"]["sysctls"]}
    reserved = sysctls["net.ipv4.ip_local_reserved_ports"]
    # every port the container listens on, and nothing else, in the kernel's list syntax
    listening = sorted(p["containerPort"] for p in c["ports"])
    assert reserved == ",".join(map(str, listening)) == "41000,55527"
    assert all(rootport.port_reserved(p, reserved) for p in listening)
    env = {e["name"]: e["value"] for e in c["env"]}
    assert env["CCOM_SOCKET_IFNAME"] == "eth0"
    other = by_kind(manifests(2, IMAGE, socket_ifname="ens5"))["Job"]
    (c,) = other["spec"]["template"]["spec"]["containers"]
    assert {e["name"]: e["value"] for e in c["env"]}["CCOM_SOCKET_IFNAME"] == "ens5"
    header = render_eks(2, IMAGE).split("---")[0]
    assert "net.ipv4.ip_local_reserved_ports=41000,55527" in header
    assert "--allowed-unsafe-sysctls" in header


def test_socket_ifname_option_validates_and_round_trips(tmp_path, capsys):
    from trn_accum import cli

    out = tmp_path / "eks.yaml"
    argv = ["render-eks", "--nodes", "2", "--image", IMAGE, "--socket-ifname", "ens32"]
    assert cli.main([*argv, "-o", str(out)]) == 0
    text = out.read_text()
    assert text == render_eks(2, IMAGE, socket_ifname="ens32")
    assert "--socket-ifname ens32" in text.splitlines()[1]  # the header's command reproduces it
    assert validate(out).returncode == 0
    for bad in ("eth 0", "", "x" * 16, "eth0/1"):
        with pytest.raises(RenderError) as e:
            manifests(2, IMAGE, socket_ifname=bad)
        assert "--socket-ifname" in str(e.value) and "\n" not in str(e.value)


def test_options_reach_the_manifest():
    d = by_kind(
        manifests(
            2,
            IMAGE,
            "configs/fuji-tiny.toml",
            name="run7",
            namespace="ml",
            pvc="ckpt",
            run_dir="/checkpoints/x y",
            train_args=("--set", "trainer.steps=5"),
            max_restarts=0,
            scheduler_name="my-scheduler",
        )
    )
    job = d["Job"]
    pod = job["spec"]["template"]["spec"]
    assert job["metadata"]["namespace"] == d["Service"]["metadata"]["namespace"] == "ml"
    assert job["spec"]["backoffLimit"] == 0
    assert pod["schedulerName"] == "my-scheduler"
    assert pod["volumes"][1]["persistentVolumeClaim"]["claimName"] == "ckpt"
    script = pod["containers"][0]["command"][-1]
    assert (
        "trn-accum train --config configs/fuji-tiny.toml --run-dir '/checkpoints/x y' "
        "--set trainer.steps=5" in script
    )


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        ({"nodes": 0}, "--nodes 0"),
        ({"nodes": "4"}, "--nodes '4'"),
        ({"image": ""}, "--image ''"),
        ({"image": "a b"}, "--image"),
        ({"name": "Fuji_3B"}, "--name 'Fuji_3B'"),
        ({"name": "x" * 62}, "63 characters"),
        ({"namespace": "ML"}, "--namespace"),
        ({"pvc": "bad pvc"}, "--pvc"),
        ({"max_restarts": -1}, "--max-restarts -1"),
    ],
)
def test_bad_values_are_one_line_errors(kwargs, fragment):
    args = {"nodes": 2, "image": IMAGE, **kwargs}
    with pytest.raises(RenderError) as e:
        render_eks(args.pop("nodes"), args.pop("image"), **args)
    assert fragment in str(e.value) and "\n" not in str(e.value)
    assert isinstance(e.value, ValueError)


def test_cli_writes_the_file(tmp_path, capsys):
    from trn_accum import cli

    out = tmp_path / "sub" / "eks.yaml"
    argv = ["--nodes", "4", "--image", EXAMPLE_IMAGE, "--set", "trainer.accum_steps=16"]
    assert cli.main(["render-eks", *argv, "-o", str(out)]) == 0
    assert out.read_text() == EXAMPLE.read_text()
    capsys.readouterr()
    assert cli.main(["render-eks", "--image", IMAGE]) == 2  # missing --nodes: one line
    err = capsys.readouterr().err.strip()
    assert "--nodes" in err and "\n" not in err and err.startswith("trn-accum: error:")


def test_cli_render_eks(tmp_path, capsys):
    from trn_accum import cli

    out = tmp_path / "eks.yaml"
    assert cli.main(["render-eks", "--nodes", "2", "--image", IMAGE, "-o", str(out)]) == 0
    assert out.read_text() == render_eks(2, IMAGE)
    assert cli.main(["render-eks", "--nodes", "0", "--image", IMAGE]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("trn-accum: error:") and "--nodes 0" in err and "\n" not in err


@pytest.mark.parametrize("check_rc, want_rc, trained", [(0, 0, True), (1, 2, False)])
def test_neuron_check_option_runs_first_and_fails_the_job(tmp_path, check_rc, want_rc, trained):
    """--neuron-check: the pod script runs `trn-accum neuron-check` before training; when a row
    fails the pod exits 2 (podFailurePolicy: FailJob, no retries) and training never starts.
    The script is run here with `trn-accum` and launch/env/trn2.sh replaced by recorders."""
    job = by_kind(manifests(2, IMAGE, neuron_check=True))["Job"]
    rules = job["spec"]["podFailurePolicy"]["rules"]
    assert {"action": "FailJob", "onExitCodes": {"containerName": "train", "operator": "In",
            "values": [2]}} in rules  # fmt: skip
    script = job["spec"]["template"]["spec"]["containers"][0]["command"][-1]
    assert script.index("trn-accum neuron-check") < script.index("exec trn-accum train")
    assert "neuron-check" not in by_kind(manifests(2, IMAGE))["Job"]["spec"]["template"][
        "spec"]["containers"][0]["command"][-1]  # fmt: skip
    (tmp_path / "launch" / "env").mkdir(parents=True)
    (tmp_path / "launch" / "env" / "trn2.sh").write_text("")
    fake = tmp_path / "bin" / "trn-accum"
    fake.parent.mkdir()
    fake.write_text(
        f'#!/bin/bash\necho "$1" >> {tmp_path}/calls\n'
        f'[[ "$1" == neuron-check ]] && exit {check_rc}\nexit 0\n'
    )
    fake.chmod(0o755)
    env = {"PATH": f"{fake.parent}:/usr/bin:/bin"}
    r = subprocess.run(
        ["bash", "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert r.returncode == want_rc, r.stderr
    calls = (tmp_path / "calls").read_text().split()
    assert calls == (["neuron-check", "train"] if trained else ["neuron-check"])
    if not trained:
        assert "neuron-check failed: not training" in r.stderr


@pytest.mark.parametrize(
    "argv, fragments",
    [
        (["--set", "trainer.notakey=1"], ["trainer.notakey"]),
        (["--set", "trainer.steps=abc"], ["trainer.steps", "abc"]),
        (["--train-arg=--no-such-flag"], ["--no-such-flag"]),
        (["--train-arg=--profile"], ["--profile", "expected one argument"]),
        (["--config", "configs/nope.toml"], ["configs/nope.toml", "no such file"]),
        (["--run-dir", "/tmp/x"], ["/tmp/x", "/checkpoints", "--run-dir-outside-volume"]),
        (["--run-dir", "runs/x"], ["runs/x", "/checkpoints"]),
        (["--run-dir", "/checkpoints/../x"], ["/checkpoints/../x", "/checkpoints"]),
    ],
)
def test_render_refuses_what_the_pods_would(argv, fragments, capsys):
    """A job that cannot work fails when it is rendered: the config and its --set overrides
    through the trainer's loader, --train-arg through the train parser, a run directory off
    the checkpoint volume: one line, exit 2, no manifest."""
    from trn_accum import cli

    assert cli.main(["render-eks", "--nodes", "2", "--image", IMAGE, *argv]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith("trn-accum: error:")
    assert all(f in err for f in fragments), err


def test_render_accepts_a_run_dir_on_the_volume_or_explicitly_outside(capsys):
    from trn_accum import cli

    base = ["render-eks", "--nodes", "2", "--image", IMAGE]
    assert cli.main([*base, "--run-dir", "/checkpoints/exp 1", "--set", "trainer.steps=5"]) == 0
    assert "--run-dir" in capsys.readouterr().out
    assert cli.main([*base, "--run-dir", "/tmp/x", "--run-dir-outside-volume"]) == 0
    assert "/tmp/x" in capsys.readouterr().out
