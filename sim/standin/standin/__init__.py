"""The vLLM stand-in's modules, run by vllm_standin.py beside this package (stdlib only: the image carries Debian's
python3 and nothing else; sim/standin/README.md says what it reproduces).

- serve: `vllm serve` itself: `main` (the command line's top level), the boot of one rank as vLLM logs it, and the
  head's and a worker's SIGTERM;
- cli: the flags vLLM knows, parsed the way argparse does, into `ServeArgs`;
- faults: the SIM_* and VLLM_* environment knobs (`SimEnv`) and the faults they inject, at boot and at run time;
- log: vLLM's log line format, the version played, the exit codes;
- checkpoint: reading /model and the Engram tables as vLLM's loader does;
- model: the tiny vocabulary and the logits every rank contributes to;
- rendezvous: the ranks' rendezvous and model steps over real TCP;
- engine: the head's engine, one model step at a time over every rank;
- chat: chat requests as vLLM validates them, and its tool rules;
- api: the OpenAI routes, `/metrics`, and the engine's throughput line.
"""
