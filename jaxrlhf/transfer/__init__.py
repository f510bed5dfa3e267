"""Moving arrays between devices, processes and host: the low layer every other layer builds on.

- `processes`: which process logs and writes, barriers and agreements between processes;
- `realloc`: host values onto devices (`put_host`), device-to-device moves of parameter
  trees between placements (also across processes), and offload to host memory;
- `host`: host values of global arrays (`host_get`), alike on every process.

Nothing here knows about models, plans or algorithms; `placement`, `models.hf_io`,
`checkpoint` and the run loop import it.
"""
