"""``python -m bench ...``: the same command as ``eventlight bench ...``."""

import typer

from eventlight.bench_cli import bench

if __name__ == "__main__":
    typer.run(bench)
