"""Small helpers every layer may use: atomic files, paths kept inside their folder, seeds, kill points, durations.

atomic_files.py (a kill leaves the old file or the new), contained_paths.py (names read from a folder
resolve inside it), seeds.py (one rule for every seed argument), fault_points.py (where tests SIGKILL),
durations.py (seconds printed as people read them: "12.3 ms", "1.23 s"), cpus.py (the CPUs a process may
use, from its affinity and cgroup quota, and the thread count chosen from them).

May import: nothing of staticformers (the bottom layer).
"""
