"""`python -m bench [--quick]`: kvgate's benchmarks, one command (see docs/benchmarks.md).

`python -m bench --soak [--requests N --concurrency C --seed S]` runs the soak instead
(bench/soak.py): writes bench/results/soak.json and soak.md.

Part 1 (safety and goodput): scenarios S1-S10 on the simulated vLLM, five arms on identical
seeded traffic (no gate, best static concurrency cap from a sweep, the Inference Gateway's
saturation rule, kvgate, a memory oracle). Part 2 (overhead): direct vs kvgate vs nginx in front
of a zero-cost backend. Writes bench/results/latest.json, latest.md and PNG plots.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import random
import shlex
import sys
import time
from pathlib import Path
from typing import Any

from kvgate.units import GiB

RESULTS = Path(__file__).resolve().parent / "results"
# Further traffic seeds a surviving cap must also survive (`--confirm-caps`) are the scenario's
# own seed plus multiples of this: far from every scenario's and run's own.
CONFIRM_SEED_STRIDE = 100_000


def cpu_model() -> str:
    """The CPU's model name as the kernel reports it (Linux procfs, as taskset and the rest of
    the benchmarks assume), "?" where it does not."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return "?"
    return next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), "?")


def machine() -> dict[str, Any]:
    try:  # the kernel's total RAM (procfs MemTotal), from the C library
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        mem = 0
    return {
        "cpu_model": cpu_model(),
        "cpus": os.cpu_count(),
        "memory_bytes": mem,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "gpu": "none (simulated)",
    }


def _bar(total: int, desc: str) -> Any:
    try:
        from tqdm import tqdm

        return tqdm(total=total, desc=desc, unit="step", dynamic_ncols=True, file=sys.stderr)
    except ImportError:  # pragma: no cover

        class Lines:
            n = 0

            def update(self, k: int = 1) -> None:
                self.n += k
                print(f"[{desc}] {self.n}/{total}", file=sys.stderr, flush=True)

            def set_postfix_str(self, s: str) -> None:
                print(f"[{desc}] {s}", file=sys.stderr, flush=True)

            def close(self) -> None:
                pass

        return Lines()


def run_safety(args: argparse.Namespace, out: dict[str, Any]) -> None:
    from bench import safety
    from bench.safety import confirmed_cap, pick_cap, run_arm
    from bench.scenarios import SCENARIOS, Scenario

    safety.quiet()
    pool: list[Scenario] = SCENARIOS if args.scenarios_from is None else scenarios_from(args.scenarios_from)
    chosen = [s for s in pool if not args.scenarios or s.key in args.scenarios]

    def caps0(scn: Any) -> list[int]:
        return [8] if args.tiny else [16] if args.quick else scn.caps

    confirm = 0 if args.quick or args.tiny else args.confirm_caps
    bar = _bar(sum(len(caps0(s)) + (0 if args.quick else 1) + confirm + 5 for s in chosen), "safety")
    rows, sweeps, described = [], {}, []
    with safety.tmpdir() as tmp:
        for scn in chosen:
            # Seeded by the scenario's place in its list, not in this run: a scenario run alone
            # plays the same traffic as in the full run.
            calls = scn.traffic(random.Random(args.seed * 1000 + pool.index(scn)), args.scale)
            cfg = safety.scaled_config(scn, args.scale)
            described.append(
                {
                    "key": scn.key,
                    "title": scn.title,
                    "engine": _engine_desc(cfg),
                    "sim": _sim_desc(cfg),
                    "traffic": (scn.traffic.__doc__ or "").strip(),
                    "requests": len(calls),
                    "speedup": scn.speedup,
                    "kvgate_flags": " ".join(scn.kvgate_flags),
                }
            )

            def arm(
                name: str,
                cap: int | None = None,
                scn: Scenario = scn,
                calls: list = calls,
            ) -> safety.ArmResult:
                bar.set_postfix_str(f"{scn.key} {name}{'' if cap is None else f' {cap}'}")
                r = run_arm(scn, name, calls, args.scale, Path(tmp), cap=cap)
                bar.update(1)
                return r

            none = arm("none")
            sweep = [arm("cap", c) for c in caps0(scn)]
            if not args.quick:  # one refinement: between the best survivor and the next OOM
                best = pick_cap(sweep)
                tried = {r.cap for r in sweep}
                if best is None:
                    nxt = max(1, min(tried) // 2)
                else:
                    above = sorted(r.cap for r in sweep if r.oom_crashes and r.cap > best.cap)
                    nxt = (best.cap + above[0]) // 2 if above else best.cap * 2
                if nxt in tried:
                    bar.update(1)
                else:
                    sweep.append(arm("cap", nxt))

            def oom_seed(c: int, scn: Scenario = scn) -> int | None:
                """The first further traffic seed cap `c` runs out of memory on, or None."""
                for j in range(1, confirm + 1):
                    seed = args.seed * 1000 + pool.index(scn) + CONFIRM_SEED_STRIDE * j
                    if arm("cap", c, calls=scn.traffic(random.Random(seed), args.scale)).oom_crashes:
                        return seed
                return None

            dropped: dict[int, int] = {}
            confirming = bool(none.oom_crashes and confirm)  # the cap is kvgate's yardstick
            if confirming:
                best, dropped = confirmed_cap(sweep, oom_seed)
            else:
                best = pick_cap(sweep)
            sweeps[scn.key] = [
                {
                    "cap": r.cap,
                    "goodput_tokens_per_s": r.goodput_tokens_per_s,
                    "oom_crashes": r.oom_crashes,
                    "failed": r.failed,
                    "abandoned": r.abandoned,
                    **({"oom_on_further_seed": dropped[r.cap]} if r.cap in dropped else {}),
                }
                for r in sorted(sweep, key=lambda r: r.cap)
            ]
            if best is None:  # every cap OOMed, here or on further traffic: report the smallest, honestly
                best = min(sweep, key=lambda r: r.cap)
                best.notes["no_surviving_cap"] = True
            elif confirming:
                best.notes["survived_further_seeds"] = confirm
            sat = arm("saturation")
            vq = arm("vllm-queue", best.cap)
            kvg = arm("kvgate")
            orc = arm("oracle")
            for r in (none, best, sat, vq, kvg, orc):
                rows.append(r.row())
    bar.close()
    out["safety"] = rows
    out["cap_sweep"] = sweeps
    out["scenarios"] = described


def module_from(path: Path) -> Any:
    """A Python file loaded by its path: scenario files live outside any package (tests/heldout)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"scenarios_{path.stem}", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"cannot load scenarios from {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def scenarios_from(path: Path) -> list[Any]:
    """The SCENARIOS list of a Python file (scenarios kept out of the committed table, such as
    tests/heldout/scenarios.py)."""
    return list(module_from(path).SCENARIOS)


def _engine_desc(cfg: Any) -> str:
    """The vLLM release and model runner the scenario plays, as the simulator resolves them."""
    from kvgate.sim.flavor import Flavor
    from kvgate.sim.model import load_model

    flavor = Flavor.of(cfg, load_model(cfg.model, cfg.dtype))
    how = "vLLM's own choice" if cfg.model_runner == "auto" else "set"
    return f"vLLM {cfg.vllm_version}, Model Runner {flavor.runner.upper()} ({how})"


def _sim_desc(cfg: Any) -> str:
    from kvgate.sim.config import SimConfig

    parts = []
    for k, v in vars(cfg).items():
        if k in ("cotenants",):
            if v:
                parts.append("cotenants=" + ",".join(f"{c.name}:{c.bytes / GiB:g}GiB@{c.start_s:g}s" for c in v))
            continue
        if v != getattr(SimConfig, k, None) and k not in ("speedup", "vllm_version", "model_runner"):
            parts.append(f"{k}={v}")
    return " ".join(parts)


def targets(out: dict[str, Any]) -> list[dict[str, Any]]:
    t: list[dict[str, Any]] = []
    by = {(r["scenario"], r["arm"]): r for r in out.get("safety", [])}
    scen = sorted({r["scenario"] for r in out.get("safety", [])})
    none_oom = [s for s in scen if s != "S7" and by[(s, "none")]["oom_crashes"] > 0]
    if scen:
        t.append(
            {
                "scenario": "all but S7",
                "check": "no-gate arm OOMs in at least one",
                "value": ", ".join(none_oom) or "none",
                "met": bool(none_oom),
            }
        )
    for s in scen:
        t.extend(goodput_targets(s, by[(s, "kvgate")], by[(s, "none")], by[(s, "static-cap")], by[(s, "oracle")]))
    ov = {(r["arm"], r["scenario"]): r for r in out.get("overhead", [])}
    chat_1, chat_32 = (
        ov.get(("kvgate", "chat, non-streaming, concurrency 1")),
        ov.get(("kvgate", "chat, non-streaming, concurrency 32")),
    )
    if chat_1 is not None and chat_32 is not None:
        # Issue 22's targets, for non-streaming chat requests with every decision logged.
        cpu, per_s, added = (
            chat_32["proxy_cpu_ms_per_request"],
            chat_32["closed_loop_requests_per_s"],
            chat_1["added_p50_ms"],
        )
        t.append(
            {
                "scenario": "overhead",
                "check": "chat: kvgate CPU <= 0.25 ms a request",
                "value": f"{cpu} ms",
                "met": cpu <= 0.25,
            }
        )
        t.append(
            {
                "scenario": "overhead",
                "check": "chat: >= 3,500 req/s at concurrency 32 on one core",
                "value": f"{per_s} req/s",
                "met": per_s >= 3500,
            }
        )
        t.append(
            {
                "scenario": "overhead",
                "check": "chat: added p50 <= 0.30 ms at concurrency 1",
                "value": f"{added} ms",
                "met": added <= 0.30,
            }
        )
        f = ov[("kvgate", "streaming 16 tokens, concurrency 1, TTFB")]["added_p50_ms"]
        t.append(
            {"scenario": "overhead", "check": "streaming added TTFB p50 <= 0.7 ms", "value": f"{f} ms", "met": f <= 0.7}
        )
    return t


def goodput_targets(
    s: str, k: dict[str, Any], none: dict[str, Any], cap: dict[str, Any], o: dict[str, Any]
) -> list[dict[str, Any]]:
    """Issue 24's targets for kvgate's arm in one scenario: 0 OOM; goodput >= 0.95 x the oracle's;
    >= 0.97 x the unprotected engine's where it survives, else >= 1.0 x the best surviving cap's;
    TTFT p99 <= 1.25 x the oracle's."""

    def ratio(check: str, mine: float | None, theirs: float | None, goal: float, more: bool, what: str = "") -> dict:
        if not mine or not theirs:
            return {"scenario": s, "check": check, "value": f"not measured ({mine} / {theirs})", "met": False}
        r = mine / theirs
        return {"scenario": s, "check": check, "value": f"{r:.2f} x{what}", "met": r >= goal if more else r <= goal}

    gk = k["goodput_tokens_per_s"]
    rows = [
        {"scenario": s, "check": "kvgate: 0 OOM crashes", "value": k["oom_crashes"], "met": k["oom_crashes"] == 0},
        ratio("kvgate goodput >= 0.95 x oracle", gk, o["goodput_tokens_per_s"] if o["completed"] else None, 0.95, True),
    ]
    if none["oom_crashes"] == 0:
        rows.append(
            ratio("kvgate goodput >= 0.97 x no gate (it survives)", gk, none["goodput_tokens_per_s"], 0.97, True)
        )
    elif not cap["notes"].get("no_surviving_cap"):
        rows.append(
            ratio(
                "kvgate goodput >= 1.0 x best surviving cap",
                gk,
                cap["goodput_tokens_per_s"],
                1.0,
                True,
                f" (cap {cap['cap']}"
                + (f", survived {n} more traffic seeds)" if (n := cap["notes"].get("survived_further_seeds")) else ")"),
            )
        )
    rows.append(ratio("kvgate TTFT p99 <= 1.25 x oracle", k["ttft_p99_s"], o["ttft_p99_s"], 1.25, False))
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n")[0])
    p.add_argument(
        "--quick",
        action="store_true",
        help="~4-minute smoke run (smaller traffic, 2-value cap sweep, short overhead phases)",
    )
    p.add_argument(
        "--scale", type=float, default=None, help="traffic scale (arrival window x scale); default 1, 0.3 with --quick"
    )
    p.add_argument("--scenarios", type=lambda s: s.split(","), default=None, help="comma-separated subset, e.g. S1,S5")
    p.add_argument(
        "--scenarios-from",
        type=Path,
        default=None,
        help="a Python file whose SCENARIOS list replaces bench/scenarios.py's (e.g. tests/heldout/scenarios.py)",
    )
    p.add_argument("--skip-safety", action="store_true")
    p.add_argument("--skip-overhead", action="store_true")
    p.add_argument("--no-profile", action="store_true", help="skip py-spy")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument(
        "--confirm-caps",
        type=int,
        default=2,
        help="where the unprotected engine runs out of memory, the best cap must also survive this many "
        "further traffic seeds to be the yardstick (the next best is tried where it does not); 0: one run",
    )
    p.add_argument("--tiny", action="store_true", help="smoke-test size: one cap value, the shortest overhead phases")
    p.add_argument("--out", type=Path, default=RESULTS)
    soak = p.add_argument_group("soak (bench/soak.py)")
    soak.add_argument("--soak", action="store_true", help="run the soak instead of the benchmarks")
    soak.add_argument("--requests", type=int, default=20_000)
    soak.add_argument("--concurrency", type=int, default=64)
    soak.add_argument("--hang-seconds", type=float, default=5.0, help="how long the backend is SIGSTOPped")
    soak.add_argument(
        "--cgroup-memory-bytes",
        type=int,
        default=None,
        help="run kvgate in a memory cgroup of its own with this limit (bench/memory_cgroup.py; root)",
    )
    args = p.parse_args(argv)
    command = "python -m bench " + shlex.join(argv if argv is not None else sys.argv[1:])
    if args.soak:
        from bench import soak as soak_mod

        s = soak_mod.main(
            args.requests,
            args.concurrency,
            args.seed,
            args.hang_seconds,
            args.out,
            command,
            machine(),
            args.cgroup_memory_bytes,
        )
        return 0 if all(t["met"] for t in s["targets"]) else 1
    if args.scale is None:
        args.scale = 0.3 if args.quick else 1.0
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    out: dict[str, Any] = {
        "machine": machine(),
        "command": command,
        "started_at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "quick": args.quick,
        "scale": args.scale,
        "seed": args.seed,
        "safety": [],
        "overhead": [],
    }
    if not args.skip_safety:
        run_safety(args, out)
    if not args.skip_overhead:
        from bench.overhead import run_overhead

        bar = _bar((1 if args.tiny else 2 if args.quick else 3) * 3, "overhead")
        ov = run_overhead(args.out, quick=args.quick, profile=not args.no_profile, progress=bar, tiny=args.tiny)
        bar.close()
        out["overhead"] = ov.pop("rows", [])
        out["overhead_detail"] = ov
    out["targets"] = targets(out)
    out["duration_s"] = round(time.monotonic() - started, 1)
    from bench.report import markdown, plots

    try:
        out["plots"] = plots(out, args.out)
    except ImportError as exc:
        out["plots"] = []
        print(f"no plots ({exc}); pip install -e '.[bench]'", file=sys.stderr)
    (args.out / "latest.json").write_text(json.dumps(out, indent=2) + "\n")
    (args.out / "latest.md").write_text(markdown(out))
    print(markdown(out))
    print(
        f"wrote {args.out / 'latest.json'}, latest.md, {', '.join(out['plots'])} in {out['duration_s']:.0f} s",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
