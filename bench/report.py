"""bench/results/latest.md (tables) and PNG plots from the results dict."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvgate.units import MiB


def _f(x: Any, nd: int = 1) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.{nd}f}"
    return str(x)


def _rej(d: dict[str, int]) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(d.items())) or "0"


def markdown(res: dict[str, Any]) -> str:
    m = res["machine"]
    out = [
        "# kvgate benchmark results\n",
        f"`{res['command']}` on {m.get('cpu_model', '?')} ({m.get('cpus')} cores), "
        f"Python {m.get('python')}, {res['started_at']}, {res['duration_s']:.0f} s.\n",
    ]
    if res.get("safety"):
        out += [
            "## Safety and goodput (simulated vLLM; times in simulated seconds)\n",
            "| scenario | arm | OOM crashes | failed | abandoned | completed | goodput tok/s | "
            "TTFT p50 s | TTFT p99 s | rejected | preemptions |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in res["safety"]:
            arm = r["arm"] + (f" (cap {r['cap']})" if r.get("cap") else "")
            if r.get("notes", {}).get("survived_further_seeds"):  # the cap also ran on more traffic
                arm = arm[:-1] + f", survived {r['notes']['survived_further_seeds']} more traffic seeds)"
            if r.get("notes", {}).get("vllm_flags"):  # the vllm-queue arm's setting
                arm += f" (`{r['notes']['vllm_flags']}`)"
            out.append(
                f"| {r['scenario']} | {arm} | {r['oom_crashes']} | {r['failed']} | {r.get('abandoned', '-')} | "
                f"{r['completed']} | {_f(r['goodput_tokens_per_s'])} | "
                f"{_f(r['ttft_p50_s'], 2)} | {_f(r['ttft_p99_s'], 2)} | "
                f"{_rej(r['rejected'])} | {r['preemptions']} |"
            )
        out.append("")
        if res.get("targets"):
            out += ["### Targets\n", "| scenario | check | value | met |", "|---|---|---|---|"]
            for t in res["targets"]:
                out.append(f"| {t['scenario']} | {t['check']} | {t['value']} | {'yes' if t['met'] else '**no**'} |")
            out.append("")
        if res.get("cap_sweep"):
            out += ["### Static cap sweep (goodput tok/s, OOM crashes)\n"]
            for k, rows in res["cap_sweep"].items():
                out.append(
                    f"- {k}: "
                    + ", ".join(
                        f"cap {r['cap']}: {_f(r['goodput_tokens_per_s'])} ({r['oom_crashes']} OOM"
                        + (f"; OOM on traffic seed {r['oom_on_further_seed']}" if "oom_on_further_seed" in r else "")
                        + ")"
                        for r in rows
                    )
                )
            out.append("")
        out += ["### Scenarios\n"]
        for s in res.get("scenarios", []):
            out.append(
                f"- **{s['key']}** {s['title']}, on {s['engine']}: `{s['sim']}`; traffic: {s['traffic']}; "
                f"{s['requests']} requests, speed-up {s['speedup']}"
            )
        out.append("")
    ov = res.get("overhead_detail")
    if ov:
        out += [
            "## Overhead in front of a zero-cost backend\n",
            f"Pinning: proxy under test on {ov['pinning']['proxy_under_test']}; backend and "
            f"load generator on {ov['pinning']['backend_and_load_generator']}. "
            f"{ov.get('repetitions')} interleaved repetitions; {ov.get('nginx_version')}.\n",
            "| arm | measurement | added p50 ms | added p99 ms | p50 ms | p99 ms | req/s | proxy CPU ms/request |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in res["overhead"]:
            per_s = r["requests_per_s"] if r["requests_per_s"] is not None else r.get("closed_loop_requests_per_s")
            out.append(
                f"| {r['arm']} | {r['scenario']} | {_f(r['added_p50_ms'], 3)} | "
                f"{_f(r['added_p99_ms'], 3)} | {_f(r.get('latency_p50_ms'), 3)} | "
                f"{_f(r.get('latency_p99_ms'), 3)} | {_f(per_s, 0)} | {_f(r.get('proxy_cpu_ms_per_request'), 3)} |"
            )
        out.append("")
        out.append(
            f"kvgate CPU per request ({ov.get('kvgate_cpu_measured_over', 'concurrency 64')}): "
            f"{ov.get('kvgate_cpu_ms_per_request')} ms; log level {ov.get('kvgate_log_level', 'warning')}; "
            f"RSS after the load: {ov.get('kvgate_rss_bytes', 0) / MiB:.0f} MiB"
            + (
                f"; measured once kvgate's start-up work had settled ({ov['kvgate_start_up_settled_s']} s "
                "after /readyz: its preparation workers load transformers and the tokenizer).\n"
                if "kvgate_start_up_settled_s" in ov
                else ".\n"
            )
        )
        ev = ov.get("chat_evaluation_cost")
        if ev:
            out.append(
                f"The chat request evaluated in process on the proxy's core ({ev['requests']} times: parse, "
                f"render, tokenize, predict): {ev['evaluate_cpu_ms_mean']} ms CPU a request, of which "
                f"rendering and tokenizing {ev['render_and_tokenize_ms_p50']} ms (p50 wall).\n"
            )
        out += ["| prompt tokens | tokenize ms p50 | tokenize + estimate ms p50 |", "|---|---|---|"]
        for e in ov.get("estimate_cost", []):
            out.append(f"| {e['prompt_tokens']} | {e['tokenize_ms_p50']} | {e['tokenize_plus_estimate_ms_p50']} |")
        out.append("")
        prof = ov.get("profile") or {}
        if prof.get("components"):
            out += [
                f"### py-spy: where kvgate's CPU goes under concurrency-64 load "
                f"({prof['samples']} samples at {prof.get('rate_hz', '?')} Hz, "
                f"{prof['requests']} requests, "
                f"{prof.get('cpu_ms_per_request_while_sampled')} ms CPU a request)\n",
                "| component (deepest matching frame) | share | ms CPU per request |",
                "|---|---|---|",
            ]
            for c in prof["components"]:
                out.append(f"| {c['component']} | {c['share'] * 100:.1f}% | {_f(c['ms_per_request'], 3)} |")
            out.append("")
        if prof.get("top_self"):
            out += ["Top frames by self time:\n", "| self share | frame |", "|---|---|"]
            for t in prof["top_self"][:15]:
                out.append(f"| {t['share'] * 100:.1f}% | `{t['frame']}` |")
            out.append("")
        elif prof.get("error"):
            out.append(f"py-spy: {prof['error']}\n")
    return "\n".join(out) + "\n"


def arms_of(rows: list[dict[str, Any]]) -> list[str]:
    """The arms the results hold, in the order they were run (however many a run had)."""
    return list(dict.fromkeys(r["arm"] for r in rows))


def _bar_positions(groups: int, i: int, n: int) -> tuple[list[float], float]:
    """Where arm `i` of `n` draws its bar in each group, and the bar's width: the arms share
    0.8 of each group's slot, centred on the group's tick."""
    width = 0.8 / n
    return [g + (i - (n - 1) / 2) * width for g in range(groups)], width


def plots(res: dict[str, Any], outdir: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    made = []
    safety = res.get("safety") or []
    if safety:
        scen = sorted({r["scenario"] for r in safety})
        arms = arms_of(safety)
        fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
        for i, arm in enumerate(arms):
            g = [
                next((r["goodput_tokens_per_s"] for r in safety if r["scenario"] == s and r["arm"] == arm), 0)
                for s in scen
            ]
            o = [next((r["oom_crashes"] for r in safety if r["scenario"] == s and r["arm"] == arm), 0) for s in scen]
            x, w = _bar_positions(len(scen), i, len(arms))
            axes[0].bar(x, g, w, label=arm)
            axes[1].bar(x, o, w, label=arm)
        for ax, title in zip(
            axes, ("goodput (output tok/s of completed requests, sim time)", "backend OOM crashes"), strict=True
        ):
            ax.set_xticks(range(len(scen)), scen)
            ax.set_title(title, fontsize=10)
        axes[0].legend(fontsize=8)
        fig.tight_layout()
        p = outdir / "safety.png"
        fig.savefig(p, dpi=110)
        plt.close(fig)
        made.append(p.name)
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for i, arm in enumerate(arms):
            v = [
                next((r["ttft_p99_s"] or 0 for r in safety if r["scenario"] == s and r["arm"] == arm), 0) for s in scen
            ]
            x, w = _bar_positions(len(scen), i, len(arms))
            ax.bar(x, v, w, label=arm)
        ax.set_xticks(range(len(scen)), scen)
        ax.set_title("TTFT p99 of completed requests (simulated s)", fontsize=10)
        ax.legend(fontsize=8)
        fig.tight_layout()
        p = outdir / "ttft.png"
        fig.savefig(p, dpi=110)
        plt.close(fig)
        made.append(p.name)
    ov = res.get("overhead") or []
    if ov:
        lat = [r for r in ov if r["added_p50_ms"] is not None and r["arm"] != "direct"]
        fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
        labels = sorted({r["scenario"] for r in lat})
        arms = arms_of(lat)
        for i, arm in enumerate(arms):
            v = [next((r["added_p50_ms"] for r in lat if r["arm"] == arm and r["scenario"] == s), 0) for s in labels]
            y, h = _bar_positions(len(labels), i, len(arms))
            axes[0].barh(y, v, h, label=arm)
        axes[0].set_yticks(range(len(labels)), labels, fontsize=7)
        axes[0].set_title("added latency p50 (ms) vs direct", fontsize=10)
        axes[0].legend(fontsize=8)
        thr = [r for r in ov if r["requests_per_s"] is not None]
        axes[1].bar([r["arm"] for r in thr], [r["requests_per_s"] for r in thr])
        axes[1].set_title("requests/s at concurrency 64 (non-streaming)", fontsize=10)
        fig.tight_layout()
        p = outdir / "overhead.png"
        fig.savefig(p, dpi=110)
        plt.close(fig)
        made.append(p.name)
    return made
