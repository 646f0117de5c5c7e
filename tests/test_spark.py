"""Sparkline rows drawn as strings (tui.widgets.spark)."""

from __future__ import annotations

from tui.widgets.spark import BARS, columns, spark_rows


def test_columns_fold_long_histories_into_means_and_stretch_short_ones():
    assert columns([1, 3, 5, 7], 2) == [2, 6]
    assert columns([1, 2, 3, 4, 5, 6], 3) == [1.5, 3.5, 5.5]
    assert columns([1, 2], 4) == [1, 1, 2, 2]
    assert columns([], 5) == [] and columns([1.0], 0) == []


def test_one_row_runs_from_the_lowest_bar_to_the_highest():
    (row,) = spark_rows([0, 1, 2, 3, 4, 5, 6, 7], 8)
    assert row == BARS
    (row,) = spark_rows([10, 0], 4)
    assert row == BARS[-1] * 2 + BARS[0] * 2


def test_a_flat_history_is_a_level_line_and_no_data_is_blank():
    (row,) = spark_rows([3.0] * 10, 5)
    assert len(set(row)) == 1 and row[0] in BARS
    assert spark_rows([], 6, 2) == [" " * 6] * 2


def test_taller_charts_stack_full_blocks_under_the_top_bar():
    top, bottom = spark_rows([0, 1], 2, height=2)
    assert (top, bottom) == (" " + BARS[-1], BARS[0] + BARS[-1])
    top, bottom = spark_rows([0, 0.5, 1], 3, height=2)
    assert bottom[1] == BARS[-1] and top[1] in BARS and top[0] == " "
    assert all(len(r) == 3 for r in (top, bottom))
