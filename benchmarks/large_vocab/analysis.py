"""The large-vocabulary benchmark's table and goal verdicts (run.py measures; this reads).

Rows: per method, medians over the repetitions of trained tokens/s (whole call and steady state),
the FLOPs of the run (work.py), the training's peak RSS, the activation memory at the fixed
micro-batch, the eval loss. Goals (``GOALS``), each printed as a ``goal ...`` line:

* ``work_limit_over_<row>``: corelooper's steady-state speed over the row's, per repetition,
  divided by the ratio the FLOP counts allow (the row's FLOPs over corelooper's, same trained
  tokens): >= 0.95, on the bootstrap 95% interval (met / NOT met / inconclusive);
* ``floor``: corelooper's FLOPs over the exact-work floor, at most 3% above it;
* ``activation_memory``: HF's least activation memory (its leanest row) over corelooper's, >= 5;
* ``eval_loss``: corelooper's eval loss within 1e-3 (relative) of the hand-written loop's, every
  repetition (the same seed: the same model init and data order);
* ``headroom_over_<row>``: corelooper's largest micro-batch under the cap over the peer's, >= 3
  against HF's best row (TRL's printed beside it).
"""

from __future__ import annotations

import statistics

import run_bench as RB

OURS, HAND_WRITTEN = "cl_padding_free", "raw_padding_free"
# corelooper's row with [lm] loss = "chunked": what the doctor tells a run that runs out of memory to
# set; judged beside the default's (the headline stays the default [sft] run)
CHUNKED = "cl_padding_free_chunked"
GOALS = dict(work_share=0.95, floor_excess=0.03, activation=5.0, eval_rel=1e-3, headroom=3.0)
PEERS = ("hf_", "trl_")


def _row(m: str, recs: list[dict], counts: dict, mem: dict) -> dict:
    ok = [r for r in recs if "trained_tok_per_s" in r]
    if not ok:
        why = recs[0].get("skipped") or (recs[0].get("failed") or "")[-600:] if recs else "no throughput pass"
        return dict(method=m, skipped=why, **_memory_and_work(m, counts, mem))
    tps = [r["trained_tok_per_s"] for r in ok]
    steady = [r.get("trained_tok_per_s_steady") for r in ok]
    loss = [r["eval_loss"] for r in ok]
    flops = counts.get(m, {}).get("flops", {})
    return dict(
        method=m,
        n=len(ok),
        trained_tok_per_s=RB.med(tps),
        trained_tok_per_s_range=RB.rng(tps),
        steady_tok_per_s=RB.med(steady),
        steady_tok_per_s_range=RB.rng(steady),
        **_memory_and_work(m, counts, mem),
        gflop_attention=round(flops["attention"] / 1e9, 2) if flops else None,
        uncounted_ops=flops.get("uncounted"),
        peak_rss_mib=RB.med([r.get("peak_rss_self_mib") for r in ok]),
        peak_rss_process_mib=RB.med([r.get("peak_rss_mib") for r in ok]),  # eval loss included
        eval_loss=RB.med(loss),
        eval_loss_range=RB.rng(loss),
        positions_computed=ok[0]["positions_computed"],
        trained_tokens=ok[0]["trained_tokens"],
        padding_share=RB.med([r["padding_share"] for r in ok]),
        optimizer_steps=ok[0]["optimizer_steps"],
        same_trained_tokens=all(r["same_trained_tokens"] for r in ok),
    )


def _memory_and_work(m: str, counts: dict, mem: dict) -> dict:
    flops = counts.get(m, {}).get("flops", {})
    return dict(
        gflop=round(flops["total"] / 1e9, 2) if flops else None,
        activation_mib=mem.get(m, {}).get("activation_mib"),
        step_growth_mib=mem.get(m, {}).get("step_growth_mib"),
        static_rss_mib=mem.get(m, {}).get("static_rss_mib"),
    )


def table(runs: dict[str, list[dict]], counts: dict, mem: dict) -> list[dict]:
    """One row per method; each peer's best row (by median steady-state tokens/s) gets ``best_of``."""
    methods = list(dict.fromkeys([*runs, *counts, *mem]))
    rows = [_row(m, runs.get(m, []), counts, mem) for m in methods]
    for prefix in PEERS:
        cands = [r for r in rows if r["method"].startswith(prefix) and r.get("steady_tok_per_s")]
        if cands:
            max(cands, key=lambda r: r["steady_tok_per_s"])["best_of"] = prefix.rstrip("_")
    print(
        f"\n{'method':18s} {'n':>2s} {'tok/s':>8s} {'steady':>8s} {'GFLOP':>9s} {'peak MiB':>9s} "
        f"{'act. MiB':>9s} {'eval loss':>9s} best"
    )
    for r in rows:
        if "skipped" in r:
            print(f"{r['method']:18s}  -- not run: {r['skipped']}")
            continue
        print(
            f"{r['method']:18s} {r['n']:2d} {r['trained_tok_per_s']:8.1f} {r['steady_tok_per_s'] or 0:8.1f} "
            f"{r['gflop'] or 0:9.1f} {r['peak_rss_mib'] or 0:9.0f} {_num(r['activation_mib']):>9s} "
            f"{r['eval_loss']:9.4f} {r.get('best_of', '')}"
        )
    return rows


def _num(x) -> str:
    return "-" if x is None else f"{x:.0f}"


def work_limit(rows: dict, runs: dict, other: str) -> dict | None:
    """corelooper's steady-state speed over ``other``'s as a share of the FLOP ratio, per repetition."""
    ours, theirs = rows.get(OURS), rows.get(other)
    if not (ours and theirs and ours.get("gflop") and theirs.get("gflop")):
        return None
    allowed = theirs["gflop"] / ours["gflop"]
    steady = RB.paired_ratios(runs, OURS, other, "trained_tok_per_s_steady")
    whole = RB.paired_ratios(runs, OURS, other, "trained_tok_per_s")
    shares = [x / allowed for x in steady]
    share = statistics.median(shares) if shares else None
    ci = RB.median_ci95(shares)
    return dict(
        theirs=other,
        flop_ratio_allows=round(allowed, 3),
        steady_ratio=round(statistics.median(steady), 3) if steady else None,
        whole_call_ratio=round(statistics.median(whole), 3) if whole else None,
        share_of_allowed=round(share, 3) if share else None,
        ci95=ci,
        goal=GOALS["work_share"],
        verdict=RB.verdict(share, GOALS["work_share"], ci),
    )


def _fixed(value, goal, at_least: bool = True) -> str:
    """A verdict on one deterministic figure (no repetitions to bootstrap)."""
    if value is None:
        return "not measured"
    return "met" if (value >= goal if at_least else value <= goal) else "NOT met"


def judge(rows_list: list[dict], runs: dict, floor: dict, room: dict) -> dict:
    rows = {r["method"]: r for r in rows_list}  # a row some pass left out still has the others' figures
    best = {r["best_of"]: r["method"] for r in rows.values() if r.get("best_of")}
    goals: dict = {}
    for other in [*best.values(), HAND_WRITTEN]:
        goals[f"work_limit_over_{other}"] = work_limit(rows, runs, other)
    ours = rows.get(OURS, {})
    if ours.get("gflop") and floor.get("flops"):
        excess = ours["gflop"] * 1e9 / floor["flops"] - 1
        goals["floor"] = dict(
            ours_gflop=ours["gflop"],
            floor_gflop=round(floor["flops"] / 1e9, 2),
            excess=round(excess, 4),
            goal=GOALS["floor_excess"],
            verdict=_fixed(excess, GOALS["floor_excess"], at_least=False),
        )
    for name, mine in (("activation_memory", OURS), (f"activation_memory_{CHUNKED}", CHUNKED)):
        goals[name] = activation_goal(rows, mine)
    goals["eval_loss"] = eval_goal(runs)
    goals.update(headroom_goals(room, best, OURS))
    goals.update({f"{k}_{CHUNKED}": v for k, v in headroom_goals(room, best, CHUNKED).items()})
    goals = {k: v for k, v in goals.items() if v}
    print_goals(goals)
    return goals


def activation_goal(rows: dict, mine: str) -> dict | None:
    """HF's least activation memory (its leanest row) over ``mine``'s, at the fixed micro-batch."""
    # 0 MiB is a reading (a tiny smoke run's activations fit in memory the process already had)
    hf = [
        (r["activation_mib"], m)
        for m, r in rows.items()
        if m.startswith("hf_") and r.get("activation_mib") is not None
    ]
    ours = rows.get(mine, {}).get("activation_mib")
    if not hf or ours is None:
        return None
    least, which = min(hf)
    ratio = least / max(ours, 1e-9)
    return dict(
        ours=mine,
        ours_mib=ours,
        hf_least_mib=least,
        hf_row=which,
        ratio=round(ratio, 2),
        goal=GOALS["activation"],
        verdict=_fixed(ratio, GOALS["activation"]),
    )


def eval_goal(runs: dict) -> dict | None:
    mine, hand = RB.by_seed(runs, OURS, "eval_loss"), RB.by_seed(runs, HAND_WRITTEN, "eval_loss")
    rel = [abs(mine[s] - hand[s]) / hand[s] for s in sorted(mine.keys() & hand.keys())]
    if not rel:
        return None
    return dict(
        max_relative=round(max(rel), 6),
        per_repetition=[round(x, 6) for x in rel],
        goal=GOALS["eval_rel"],
        verdict=_fixed(max(rel), GOALS["eval_rel"], at_least=False),
    )


def headroom_goals(room: dict, best: dict, ours: str) -> dict:
    out = {}
    mine = room.get(ours)
    for peer, method in best.items():
        theirs = room.get(method)
        if not (mine and theirs):
            continue
        ratio = mine["tokens"] / theirs["tokens"] if theirs["tokens"] else None
        out[f"headroom_over_{method}"] = dict(
            ours_tokens=mine["tokens"],
            theirs_tokens=theirs["tokens"],
            ratio=round(ratio, 2) if ratio else None,
            ours_at_search_limit=mine["at_limit"],
            goal=GOALS["headroom"] if peer == "hf" else None,
            verdict=_fixed(ratio, GOALS["headroom"]) if peer == "hf" and ratio else "reported",
        )
    return out


def print_goals(goals: dict) -> None:
    for k, v in goals.items():
        if k.startswith("work_limit"):
            ci = "{:.3f}-{:.3f}".format(*v["ci95"]) if v["ci95"] else "too few repetitions"
            print(
                f"goal {k}: steady {v['steady_ratio']}x (whole call {v['whole_call_ratio']}x) of the "
                f"{v['flop_ratio_allows']}x the FLOPs allow = {v['share_of_allowed']} [95% {ci}] "
                f"(goal >= {v['goal']}: {v['verdict']})"
            )
        elif k == "floor":
            print(
                f"goal floor: {v['ours_gflop']} GFLOP, {v['excess']:+.2%} over the exact-work floor "
                f"{v['floor_gflop']} (goal <= {v['goal']:.0%}: {v['verdict']})"
            )
        elif k.startswith("activation_memory"):
            print(
                f"goal {k}: {v['hf_row']} {v['hf_least_mib']} MiB / {v['ours']} "
                f"{v['ours_mib']} MiB = {v['ratio']}x (goal >= {v['goal']}: {v['verdict']})"
            )
        elif k == "eval_loss":
            print(
                f"goal eval_loss: at most {v['max_relative']:.2e} relative to the hand-written loop "
                f"(goal <= {v['goal']}: {v['verdict']})"
            )
        elif k.startswith("headroom"):
            print(
                f"goal {k}: {v['ours_tokens']} / {v['theirs_tokens']} tokens = {v['ratio']}x "
                f"(goal >= {v['goal']}: {v['verdict']})"
            )
