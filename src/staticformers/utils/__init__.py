"""Small helpers every layer may use: atomic files, paths kept inside their folder, seeds, kill points.

atomic_files.py (a kill leaves the old file or the new), contained_paths.py (names read from a folder
resolve inside it), seeds.py (one rule for every seed argument), fault_points.py (where tests SIGKILL).

May import: nothing of staticformers (the bottom layer).
"""
