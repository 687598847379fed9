"""`eejax bench`: decoding settings measured on this device against full depth in the same run.

settings   what a setting string asks for ("full", "draft:4:lookup", "exit=softmax:0.9")
prompts    the prompts a run decodes: built-in sets (chat, code, pydoc) or a JSON-lines file
paired     timing a configuration between two runs of its peer, median over repeats
run        the table: a row per setting and batch (`bench`), and the run's environment
"""

from eejax.bench.run import BenchRow, bench, environment
from eejax.bench.settings import Setting, parse_setting

__all__ = ["BenchRow", "Setting", "bench", "environment", "parse_setting"]
