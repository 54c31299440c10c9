"""The tools built on the reducer: ``python -m reducer COMMAND`` (or ``ddp-reducer COMMAND``).

Each is a module (or a small package) of its own, used through the command line
(:mod:`reducer.tools.cli`) or imported by name:

    simulate   N ranks as threads of one process on the fake world, every step checked
               exactly against the rank-order average; timings, traces, a bucket-cap sweep
    validate   the validation suite on gloo or NCCL processes (or fakepg threads), exact on
               dyadic data and against torch's DistributedDataParallel
    launch     an unmodified torchrun script on N rank threads of the fake world
    check      the replica check at every optimizer step (launch's default; run_checked)
    whatif     the step-time prediction per bucket cap, from a profiled backward
    trace      Chrome / Perfetto timelines of what each rank did
    shortcuts  the whatif, trace and check commands: simulate or launch with one thing settled
    benchmarks the ``benchmark`` command: the repository's benchmark scripts, listed and run
    catalog    what the tools know by name (models, presets, GPUs), listed in --help
    cli        the ``python -m reducer`` dispatcher

Dependencies point one way: the tools import the core (``reducer``) and the fake world
(``fakepg``); nothing outside this package imports it. Nothing is imported here, so that the
command line loads only the subcommand it runs (one tool's heavy dependencies never slow or
break another).
"""

__all__: list[str] = []
