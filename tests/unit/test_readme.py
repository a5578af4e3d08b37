"""The README is the front door: its first screen says what kvgate is, how to install and run it,
and where each doc is; the docs behind it document every flag and metric kvgate really has, and
the README's `kvgate serve` line is one kvgate accepts."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from kvgate.cli import parse_command_line, parse_listen, with_model_folder
from kvgate.metrics import KvgateMetrics
from kvgate.settings import Settings, settings_from_args
from kvgate.sim.presets import write_model_folder
from kvgate.vllm_flags import VllmFlags

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
FIRST_SCREEN = "\n".join(README.splitlines()[:70])


def _section(markdown: str, heading: str) -> str:
    """The text under `heading` up to the next heading of the same or a higher level."""
    level = heading.split(" ", 1)[0]
    body = markdown.split(f"\n{heading}\n", 1)[1]
    return re.split(rf"\n#{{1,{len(level)}}} ", body, maxsplit=1)[0]


def test_every_serve_flag_is_a_row_of_the_flag_table() -> None:
    table = _section((ROOT / "docs" / "configuration.md").read_text(), "## Every flag")
    rows = [line.split("|")[1] for line in table.splitlines() if line.startswith("| `--")]
    missing = [n for n in Settings.model_fields if not any(f"`--{n.replace('_', '-')}`" in r for r in rows)]
    assert missing == []


def test_every_kvgate_metric_is_a_row_of_the_metrics_doc() -> None:
    rows = [
        line.split("|")[1] for line in (ROOT / "docs" / "metrics.md").read_text().splitlines() if line.startswith("| `")
    ]
    families = {m.name: m.type for m in KvgateMetrics().registry.collect()}
    exported = {f"{name}_total" if kind == "counter" else name for name, kind in families.items()}
    documented = {re.sub(r"\{.*", "", n) for r in rows for n in re.findall(r"`(kvgate_[a-z_]+(?:\{[a-z_,]+\})?)`", r)}
    assert sorted(exported - documented) == []
    assert sorted(documented - exported) == []


def test_the_first_screen_says_how_to_install_run_try_and_test() -> None:
    for needle in ("pip install .", "docker build", "kvgate serve", "make demo", "make unit", "make test"):
        assert needle in FIRST_SCREEN, needle


def test_the_first_screen_maps_every_doc() -> None:
    missing = [p.name for p in sorted((ROOT / "docs").glob("*.md")) if f"(docs/{p.name})" not in FIRST_SCREEN]
    assert missing == []


def test_the_readme_serve_line_is_one_kvgate_accepts(tmp_path: Path) -> None:
    """The command an operator copies: every flag real, every value valid, vLLM's folder as --model."""
    blocks = re.findall(r"```\n(.*?)```", FIRST_SCREEN, flags=re.S)
    (block,) = [b for b in blocks if re.search(r"^kvgate serve ", b, flags=re.M)]
    command = block[block.index("\nkvgate serve") + 1 :].replace("\\\n", " ").splitlines()[0]
    argv = shlex.split(command)[1:]
    folder = argv[argv.index("--model") + 1]
    argv[argv.index("--model") + 1] = str(write_model_folder("llama-3.1-8b", tmp_path / Path(folder).name))
    args = parse_command_line(argv)
    assert args.ignored_vllm_options == []
    settings = with_model_folder(settings_from_args(args))
    assert parse_listen(settings.listen) == ("0.0.0.0", 8080)
    assert settings.backend == "http://127.0.0.1:8000"
    # the vLLM line above it is a real `vllm serve` command (kvgate knows vLLM 0.32.0's options and
    # refuses others), and kvgate's line mirrors every vLLM flag it sets
    *environment, vllm_serve = re.split(
        r"(?=vllm serve )", next(line for line in block.splitlines() if "vllm serve " in line)
    )
    vllm = shlex.split(vllm_serve)
    assert vllm[2] == folder
    # kvgate is told what vLLM's environment says of its allocator, which it cannot read
    assert settings.expandable_segments == ("PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in "".join(environment))
    pasted = settings_from_args(parse_command_line(["serve", "--", *vllm]))
    engine = list(VllmFlags.model_fields)
    assert {f: getattr(settings, f) for f in engine} == {f: getattr(pasted, f) for f in engine}


def _serve_lines() -> list[tuple[str, str]]:
    """Every `kvgate serve` command in a fenced block of the README or docs/, continuations joined."""
    lines = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for block in re.findall(r"^```\n(.*?)^```", page.read_text(), flags=re.M | re.S):
            for line in block.replace("\\\n", " ").splitlines():
                if line.startswith("kvgate serve "):
                    lines.append((page.name, line))
    return lines


@pytest.mark.parametrize(("page", "line"), _serve_lines())
def test_every_documented_serve_command_parses(page: str, line: str) -> None:
    """A flag renamed or removed leaves no command in the docs that kvgate would refuse."""
    args = parse_command_line(shlex.split(line)[1:])
    assert args.ignored_vllm_options == []
    settings_from_args(args)
