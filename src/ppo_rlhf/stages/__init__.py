"""Stage runners: load what a stage needs, run its trainer, save checkpoints, write the run folder.

Each ``run_*`` takes its config dataclass and returns the summary it wrote to ``summary.json``.
The CLI and the demo call these; the trainers they call know nothing of files.
"""
