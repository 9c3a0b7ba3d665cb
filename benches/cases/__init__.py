"""One module of benchmark cases per family; each has ``run(rounds, threads, quick)``."""
