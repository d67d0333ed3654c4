"""Aggregate benchmark results and write results.json, results.md, plots and trajectory.html."""

from __future__ import annotations

import html
import json
import math
import platform
import statistics
from datetime import date
from pathlib import Path
from typing import Any

from failfast.bench.runner import BASELINE, PromptResult
from failfast.decode.stats import acceptance_by_position
from failfast.model import Tokenizer

# The paper's latency profile (NVIDIA A6000): one drafter forward, and one target forward.
PAPER_DRAFTER_PASS_MS = 6.1
PAPER_TARGET_MS = {"7B": 13.5, "14B": 24.7, "32B": 52.6}


def cost_model_speedup(tokens: int, rounds: int, drafter_forwards: int, target_ms: float) -> float:
    """AR cost (one target forward per token) over speculative cost (rounds + drafter passes)."""
    return tokens * target_ms / (rounds * target_ms + drafter_forwards * PAPER_DRAFTER_PASS_MS)


def _geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


def summarize(results: list[PromptResult], method_names: list[str]) -> list[dict[str, Any]]:
    summary = []
    for name in method_names:
        speedups = [statistics.median(r.times[BASELINE]) / statistics.median(r.times[name]) for r in results]
        row: dict[str, Any] = {
            "name": name,
            "lossless": all(r.outputs[name].token_ids == r.outputs[BASELINE].token_ids for r in results),
            "speedup_median": statistics.median(speedups),
            "speedup_geomean": _geomean(speedups),
            "tokens_per_s_median": statistics.median(
                len(r.outputs[name].token_ids) / statistics.median(r.times[name]) for r in results),
        }
        stats = [r.outputs[name].stats for r in results]
        if all(s is not None for s in stats):
            tokens, rounds = sum(s.tokens for s in stats), sum(s.rounds for s in stats)
            drafted, accepted = sum(s.drafted for s in stats), sum(s.accepted for s in stats)
            row.update(tokens_per_target_forward=tokens / rounds, acceptance_rate=accepted / drafted if drafted else None)
            if drafted and any(s.trajectory for s in stats):  # engines that hide their rounds (vLLM) have none
                row["acceptance_by_position"] = acceptance_by_position(r for s in stats for r in s.trajectory)
        if all(s is not None and s.wall_s > 0 for s in stats):  # our engine's own timings (not vLLM's)
            passes = sum(s.drafter_forwards for s in stats)
            wall, draft = sum(s.wall_s for s in stats), sum(s.draft_s for s in stats)
            row.update(
                drafter_forwards_per_round=passes / rounds,
                draft_time_share=draft / wall,
                verify_time_share=sum(s.verify_s for s in stats) / wall,
                cost_model_speedup={size: cost_model_speedup(tokens, rounds, passes, ms)
                                    for size, ms in PAPER_TARGET_MS.items()},
            )
        summary.append(row)
    return summary


def _fmt(value: Any, digits: int = 2) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def _decoding(meta: dict[str, Any]) -> str:
    temperature = meta.get("temperature", 0.0)
    return f"sampled at temperature {temperature}" if temperature else "greedy"


def markdown_table(summary: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    lines = [f"# failfast bench — {meta['dataset']}, {meta['prompts']} prompts, {meta['max_new_tokens']} new tokens",
             "", f"{meta['date']}, {meta['machine']}, {meta.get('dtype', 'float32')}, {_decoding(meta)}; "
             f"median of {meta['repeats']} interleaved repeats per prompt. "
             "Speedup is plain AR time / method time, per prompt, then median (and geometric mean) over prompts. "
             "Cost model: the paper's A6000 latencies (6.1 ms per drafter pass; target 13.5/24.7/52.6 ms).", "",
             "| method | lossless | speedup (median) | speedup (geomean) | tok/s | tokens / target fwd | "
             "acceptance | drafter fwd / round | draft time | cost model 7B / 14B / 32B |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for m in summary:
        cost = m.get("cost_model_speedup")
        cost_text = " / ".join(f"{v:.2f}x" for v in cost.values()) if cost else "n/a"
        share = m.get("draft_time_share")
        lines.append(f"| {m['name']} | {'yes' if m['lossless'] else 'differs (own kernels)'} | {m['speedup_median']:.2f}x | "
                     f"{m['speedup_geomean']:.2f}x | {m['tokens_per_s_median']:.1f} | "
                     f"{_fmt(m.get('tokens_per_target_forward'))} | {_fmt(m.get('acceptance_rate'))} | "
                     f"{_fmt(m.get('drafter_forwards_per_round'))} | "
                     f"{'n/a' if share is None else f'{100 * share:.0f}%'} | {cost_text} |")
    drafting = [m for m in summary if m.get("acceptance_by_position")]
    if drafting:
        width = len(drafting[0]["acceptance_by_position"])
        lines += ["", "Acceptance by draft position: the share of rounds whose i-th draft token was accepted, among "
                  "those that verified it with every earlier one accepted (n/a: no round got that far).", "",
                  "| method | " + " | ".join(str(i + 1) for i in range(width)) + " |", "|---|" + "---|" * width]
        lines += [f"| {m['name']} | " + " | ".join(_fmt(v) for v in m["acceptance_by_position"]) + " |"
                  for m in drafting]
    return "\n".join(lines) + "\n"


def write_plots(results: list[PromptResult], summary: list[dict[str, Any]], out: Path) -> list[str]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [m["name"] for m in summary]
    fig, ax = plt.subplots(figsize=(10, 5))
    ax.bar(names, [m["speedup_median"] for m in summary], color=["#d62728" if n == "failfast" else "#1f77b4" for n in names])
    ax.axhline(1.0, color="gray", lw=1, ls="--")
    ax.set_ylabel("median speedup over plain AR (wall clock)")
    ax.set_title("Speedup per method")
    ax.tick_params(axis="x", rotation=60)
    fig.tight_layout()
    fig.savefig(out / "speedup.png", dpi=110)
    plt.close(fig)

    spec_names = [n for n in names if all(r.outputs[n].stats is not None and r.outputs[n].stats.drafted
                                          for r in results)]
    fig, ax = plt.subplots(figsize=(8, 5))
    for n in spec_names:
        accepted = sorted(rd.accepted for r in results for rd in r.outputs[n].stats.trajectory)
        ax.step(accepted, [(i + 1) / len(accepted) for i in range(len(accepted))], where="post", label=n)
    ax.set_xlabel("accepted draft tokens in a round")
    ax.set_ylabel("share of rounds (CDF)")
    ax.set_title("Accepted tokens per round")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(out / "accepted_cdf.png", dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(10, 4))
    first = results[0]
    for n in [x for x in ("failfast", "dllm-fixed-10", "ar-fixed-4") if x in spec_names]:
        traj = first.outputs[n].stats.trajectory
        ax.plot(range(1, len(traj) + 1), [rd.accepted for rd in traj], marker="o", ms=3, label=f"{n} accepted")
        if n == "failfast":
            ax.bar(range(1, len(traj) + 1), [rd.drafted for rd in traj], alpha=0.2, color="gray", label="failfast drafted")
    ax.set_xlabel("round")
    ax.set_ylabel("tokens")
    ax.set_title(f"One generation, round by round ({first.prompt_id})")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "acceptance_rounds.png", dpi=110)
    plt.close(fig)
    return ["speedup.png", "accepted_cdf.png", "acceptance_rounds.png"]


def _visible(text: str) -> str:
    """Whitespace made visible, for token-by-token display."""
    return html.escape(text.replace(" ", "\u00b7").replace("\n", "\u21b5").replace("\t", "\u2192"))


def trajectory_html(result: PromptResult, method: str, prompt_text: str, tokenizer: Tokenizer) -> str:
    """One generation, round by round: accepted drafts green, the target's own token
    (correction or bonus) blue, and the count of rejected drafts in red."""
    out = result.outputs[method]
    tokens, rows, inline, pos = out.token_ids, [], [], 0
    for i, rd in enumerate(out.stats.trajectory, 1):
        accepted = tokens[pos:pos + rd.accepted]
        own = tokens[pos + rd.accepted:pos + rd.accepted + 1]
        cells = [f'<span class="acc" title="confidence {c:.2f}">{_visible(tokenizer.decode([t]))}</span>'
                 for t, c in zip(accepted, rd.confidences)]
        cells += [f'<span class="own">{_visible(tokenizer.decode(own))}</span>'] if own else []
        rejected = rd.drafted - rd.accepted
        rej = f' <span class="rej">{rejected} rejected</span>' if rejected else ""
        rows.append(f"<tr><td>{i}</td><td>{rd.drafted}</td><td>{rd.accepted}</td><td>{rd.drafter_forwards}</td>"
                    f"<td class=code>{''.join(cells)}{rej}</td></tr>")
        inline.append(f'<span class="acc" title="round {i}">{html.escape(tokenizer.decode(accepted))}</span>'
                      f'<span class="own" title="round {i}">{html.escape(tokenizer.decode(own))}</span>')
        pos += rd.accepted + 1
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>failfast trajectory: {html.escape(result.prompt_id)}</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 2em; max-width: 1100px; }}
pre, .code {{ font-family: ui-monospace, monospace; white-space: pre-wrap; }}
pre {{ background: #f6f6f6; padding: 0.8em; }}
table {{ border-collapse: collapse; width: 100%; }}
td, th {{ border-bottom: 1px solid #ddd; padding: 4px 8px; vertical-align: top; text-align: left; }}
.acc {{ background: #c8f7c5; }} .own {{ background: #bcd7ff; font-weight: bold; }}
.rej {{ color: #b00020; font-size: 0.8em; }}
</style></head><body>
<h1>One generation with <code>{html.escape(method)}</code></h1>
<p>Prompt <code>{html.escape(result.prompt_id)}</code>: {len(tokens)} tokens in {len(out.stats.trajectory)} target
forwards. <span class="acc">Accepted draft tokens</span> are green; <span class="own">the target's own token</span>
(a correction, or a bonus when the whole draft was accepted) is blue.</p>
<h2>Prompt</h2><pre>{html.escape(prompt_text)}</pre>
<h2>Generated</h2><pre>{''.join(inline)}</pre>
<h2>Round by round</h2>
<table><tr><th>round</th><th>drafted</th><th>accepted</th><th>drafter passes</th><th>committed tokens (\u00b7 space, \u21b5 newline)</th></tr>
{''.join(rows)}
</table></body></html>
"""


def write_report(results: list[PromptResult], method_names: list[str], meta: dict[str, Any], out: Path,
                 tokenizer: Tokenizer, prompt_texts: dict[str, str]) -> dict[str, Any]:
    out.mkdir(parents=True, exist_ok=True)
    meta = {**meta, "date": date.today().isoformat(),
            "machine": f"{platform.machine()} {platform.processor() or ''} {meta.get('threads', '?')} threads".strip()}
    summary = summarize(results, method_names)
    per_prompt = [{"id": r.prompt_id, "prompt_tokens": r.prompt_tokens,
                   "generated_tokens": len(r.outputs[BASELINE].token_ids),
                   "methods": {n: {"median_s": statistics.median(r.times[n]), "times_s": r.times[n],
                                   "speedup": statistics.median(r.times[BASELINE]) / statistics.median(r.times[n]),
                                   "stats": None if r.outputs[n].stats is None else r.outputs[n].stats.to_dict()}
                               for n in method_names}} for r in results]
    report = {"meta": meta, "methods": summary, "prompts": per_prompt}
    (out / "results.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / "results.md").write_text(markdown_table(summary, meta))
    report["plots"] = write_plots(results, summary, out)
    showcase = "failfast" if "failfast" in method_names else next(
        (n for n in method_names if results[0].outputs[n].stats is not None), None)
    if showcase is not None:
        (out / "trajectory.html").write_text(trajectory_html(results[0], showcase, prompt_texts[results[0].prompt_id],
                                                             tokenizer))
    return report
