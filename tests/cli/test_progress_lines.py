"""In a pipe, each stage's "in X s" is its own time: stages that take turns layer by layer (calibrating, AWQ,
GPTQ) add up to the time they ran together, not each to all of it."""

from __future__ import annotations

from qconvert.progress import Lines


def test_stages_that_take_turns_each_count_their_own_time():
    written, now = [], [0.0]
    lines = Lines(written.append, every=1000.0, clock=lambda: now[0])
    now[0] = 5.0  # loading before any stage: no stage's time
    for stage in ("calibrating", "AWQ search", "GPTQ"):
        lines.step(stage, 0, 3)
    for layer in (1, 2, 3):  # per layer: 2 s of forward, 1 s of AWQ, 3 s of GPTQ
        now[0] += 2.0
        lines.step("calibrating", layer, 3)
        now[0] += 1.0
        lines.step("AWQ search", layer, 3, "groups")
        lines("a line between steps")
        now[0] += 3.0
        lines.step("GPTQ", layer, 3)
    assert [line for line in written if " in " in line] == [
        "calibrating: 3/3 layers in 6.0 s", "AWQ search: 3/3 groups in 3.0 s", "GPTQ: 3/3 layers in 9.0 s"]
    assert now[0] - 5.0 == 18.0  # the figures add up to the run's time

    now[0] += 100.0  # time outside every stage (writing, say) counts for none
    lines.step("verify", 0, 2, "checks")
    now[0] += 0.5
    lines.step("verify", 1, 2, "checks")
    now[0] += 1.5
    lines.step("verify", 2, 2, "checks")
    assert written[-1] == "verify: 2/2 checks in 2.0 s"


def test_a_stage_first_heard_mid_way_counts_from_then():
    written, now = [], [0.0]
    lines = Lines(written.append, every=10.0, clock=lambda: now[0])
    lines.step("writing", 3, 9)  # first heard mid-way: counts from here
    now[0] = 4.0
    lines.step("writing", 9, 9)
    assert written == ["writing: 9/9 layers in 4.0 s"]
