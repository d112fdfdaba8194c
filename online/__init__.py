"""Online mode: the simulated engine behind an OpenAI-compatible HTTP endpoint, paced to the
wall clock (``python -m experiments.serve``). ``sim.online`` drives the engine; this package
is the server around it: ``pacer`` (the wall clock), ``protocol`` (the OpenAI API's requests
and errors), ``tokens`` (prompt lengths, output text), ``metrics`` (``/metrics`` with vLLM's
names) and ``app`` (the FastAPI routes). Needs the ``serve`` extra."""
