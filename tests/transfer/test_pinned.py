"""kvshm.transfer.cuda.pinned: descriptor tables lent to jobs, taken back when the jobs are done."""

from __future__ import annotations

import numpy as np

from kvshm.transfer.cuda.pinned import MIN_COLUMNS, PinnedTables
from kvshm.transfer.jobs.work import Lease
from kvshm.transfer.ordering.timeline import CpuTimeline


def test_a_table_is_at_least_as_wide_as_asked_in_a_few_widths() -> None:
    tables = PinnedTables(pinned=False)
    widths = {columns: tables.take(columns).rows.shape for columns in (1, 64, 65, 896, 1024)}
    assert widths == {
        1: (3, MIN_COLUMNS),
        64: (3, 64),
        65: (3, 128),
        896: (3, 1024),
        1024: (3, 1024),
    }
    table = tables.take(100)
    table.rows[1, 5] = 42  # rows and tensor are one memory
    assert table.tensor[1, 5].item() == 42 and table.rows.dtype == np.int64


def test_a_given_back_table_is_lent_again_for_a_job_of_its_width() -> None:
    tables = PinnedTables(pinned=False)
    first = tables.take(900)
    assert tables.take(900) is not first  # still lent: another one
    first.release()
    assert tables.bytes_kept == first.rows.nbytes
    assert tables.take(100) is not first  # another width
    assert tables.take(1000) is first and tables.bytes_kept == 0


def test_the_pool_keeps_a_bounded_number_of_bytes() -> None:
    one = 3 * 8 * 1024
    tables = PinnedTables(pinned=False, bytes_kept=2 * one)
    lent = [tables.take(1024) for _ in range(3)]
    for table in lent:
        table.release()
    assert tables.bytes_kept == 2 * one  # the third was left to torch
    assert {id(tables.take(1024)) for _ in range(2)} == {id(t) for t in lent[:2]}


def test_the_cpu_timeline_releases_what_a_job_lends_once_its_copies_ran() -> None:
    released: list[str] = []

    class Kept(Lease):
        def release(self) -> None:
            released.append("kept")

    timeline = CpuTimeline()
    ticket = timeline.launch(lambda stream: Kept(), None)
    ticket.synchronize()
    timeline.close()
    assert released == ["kept"] and ticket.error is None
