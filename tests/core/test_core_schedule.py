"""The prefetch schedule on plain group indices: the order it learns, and what it copies ahead of each group."""
import logging

from offload_core.schedule import Schedule


def run(schedule: Schedule, order: list[int]) -> None:
    for index in order:
        schedule.saw(index)


def test_nothing_is_copied_ahead_until_the_order_is_learnt():
    schedule = Schedule(4, prefetch=1)
    run(schedule, [0, 1, 2])
    assert not schedule.learnt and schedule.after(0) == []
    schedule.saw(3)
    assert schedule.learnt
    assert [schedule.after(i) for i in range(4)] == [[1], [2], [3], [0]]  # cyclic: the last one fetches the first


def test_the_learnt_order_is_the_order_the_groups_ran_in_not_their_index():
    schedule = Schedule(4, prefetch=2)
    run(schedule, [2, 0, 3, 1])
    assert schedule.after(2) == [0, 3] and schedule.after(1) == [2, 0]
    run(schedule, [0, 1, 2, 3])  # later forwards do not change a learnt order
    assert schedule.after(2) == [0, 3]


def test_resident_groups_are_never_copied_ahead():
    schedule = Schedule(5, prefetch=2)
    schedule.use_plan([False, True, False, True, True], prefetch=2)
    run(schedule, range(5))
    assert [schedule.after(i) for i in range(5)] == [[1, 3], [3, 4], [3, 4], [4, 1], [1, 3]]


def test_a_new_plan_replans_a_learnt_lookahead():
    schedule = Schedule(3, prefetch=2)
    run(schedule, range(3))
    assert schedule.after(0) == [1, 2]
    schedule.use_plan([True, True, False], prefetch=1)
    assert (schedule.prefetch, schedule.after(0), schedule.after(2)) == (1, [1], [0])


def test_a_group_never_prefetches_itself_even_when_it_streams_alone():
    schedule = Schedule(3, prefetch=2)
    schedule.use_plan([False, True, False], prefetch=2)
    run(schedule, range(3))
    assert [schedule.after(i) for i in range(3)] == [[1], [], [1]]


def test_the_order_is_complete_when_the_first_group_runs_again(caplog):
    schedule = Schedule(4, prefetch=1)
    with caplog.at_level(logging.WARNING, logger="offload_core.schedule"):
        run(schedule, [0, 2, 0])  # groups 1 and 3 were skipped by the first forward
    assert schedule.learnt and "2 offloaded group(s) did not run" in caplog.text
    assert schedule.after(0) == [2] and schedule.after(2) == [0] and schedule.after(1) == []


def test_an_order_left_unfinished_is_forgotten_a_learnt_one_is_not():
    schedule = Schedule(3, prefetch=1)
    run(schedule, [1, 2])
    schedule.forget_unfinished()
    run(schedule, [0, 1, 2])
    assert schedule.after(0) == [1]  # learnt from the second forward, which started at 0
    schedule.forget_unfinished()
    assert schedule.learnt and schedule.after(2) == [0]


def test_prefetch_zero_copies_nothing_ahead():
    schedule = Schedule(3, prefetch=0)
    run(schedule, range(3))
    assert schedule.learnt and all(schedule.after(i) == [] for i in range(3))
