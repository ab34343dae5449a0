"""compilation/progress.py: what a compile of many shapes says while it runs (count, current shape, estimate)."""

from staticformers.compilation.progress import FIRST_GUESS, CompileProgress


def run(total, seconds, backend="inductor", hits=()):
    lines = []
    progress = CompileProgress(
        total,
        backend,
        write=lines.append,
        describe=lambda r: f"done {r['shape']} {'hit' if r['cache_hit'] else 'compiled'}",
    )
    progress.begin()
    for i, s in enumerate(seconds):
        progress({"kind": "decode", "shape": [1, 1, 256 * (i + 1)], "seconds": s, "cache_hit": i in hits, "graphs": 1})
    return lines


def test_the_count_comes_first_with_the_stated_figure_then_each_shape_with_this_run_s_pace():
    lines = run(3, [10.0, 20.0, 30.0])
    assert lines[0] == f"compiling 3 shapes (each one step's graphs; no shape timed yet; {FIRST_GUESS['inductor']})"
    assert lines[1] == "compiling shape 1/3"
    assert lines[2] == "done [1, 1, 256] compiled"
    assert lines[3] == "compiling shape 2/3 (about 20.0 s left: 10.0 s a shape so far in this run)"
    assert lines[5] == "compiling shape 3/3 (about 15.0 s left: 15.0 s a shape so far in this run)"
    assert lines[-1] == "done [1, 1, 768] compiled" and len(lines) == 7  # nothing announced after the last


def test_a_backend_without_a_figure_says_so_and_one_shape_is_singular():
    lines = run(1, [0.5], backend="openxla")
    assert lines[0] == "compiling 1 shape (each one step's graphs; no shape timed yet, and no figure for openxla)"
    assert lines[1:] == ["compiling shape 1/1", "done [1, 1, 256] compiled"]


def test_nothing_to_compile_says_nothing():
    assert run(0, []) == []
