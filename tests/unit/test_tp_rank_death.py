"""Which rank a tensor-parallel group names when followers die (``TPGroup._exited_follower``): the
first death, not a follower that exited because of it or that rank 0 killed after it."""

from __future__ import annotations

from engine.distributed.group import TPGroup


class Follower:
    def __init__(self, pid, code, on_poll=None):
        self.pid, self.code, self.on_poll = pid, code, on_poll

    def poll(self):
        if self.on_poll is not None:
            self.on_poll()
        return self.code


def group(followers, dead=None) -> TPGroup:
    g = TPGroup.__new__(TPGroup)
    g._followers, g._dead = followers, dead
    return g


def test_a_death_the_watch_thread_named_meanwhile_wins_over_the_rank_it_then_killed():
    # rank 2 was SIGKILLed; while rank 0's forward looks for the cause, the watch thread names rank 2
    # (sets _dead) and kills rank 1: polling rank 1 now shows signal 9 too. The old code named rank 1.
    g = group([])
    named = "tensor-parallel rank 2 (pid 20) exited with signal 9"
    g._followers = [Follower(10, -9, on_poll=lambda: setattr(g, "_dead", named)), Follower(20, -9)]
    assert g._exited_follower() == named


def test_a_killed_rank_is_named_before_one_that_exited_after_its_collective_failed():
    g = group([Follower(10, 1), Follower(20, -9)])  # rank 1 exited (its all-reduce failed), rank 2 killed
    assert g._exited_follower() == "tensor-parallel rank 2 (pid 20) exited with signal 9"


def test_no_death_is_none_and_a_single_death_is_named():
    assert group([Follower(10, None), Follower(20, None)])._exited_follower() is None
    assert group([Follower(10, None), Follower(20, 3)])._exited_follower() == \
        "tensor-parallel rank 2 (pid 20) exited with exit code 3"
