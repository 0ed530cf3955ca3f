"""The device suite: one script (`run.sh`) that measures the project on one GPU and writes JSON
and markdown.

`env` runs first (what the machine runs, what imports); then each part is a module run in its
own process (`python -m benchmarks.device.PART --out FILE`) so that one part's crash, hang or
out-of-memory loses only its own results; `summary` gathers them and reads the targets,
`to_markdown` writes tables.md. `--quick` runs the rows the targets are read at, `--smoke` every
part at toy sizes on CPU (CI). See README.md beside this file.
"""
