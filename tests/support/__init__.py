"""What the test modules share: fakes, the harness of real components, and helpers.

A test module (tests/*/test_*.py) imports from here, never from another test
module (the import contract in pyproject.toml). By topic:

- `cli`: the one in-process runner of the `fabric` command, `fabric(capsys, *argv)`.
- `audit`, `clock`, `fakes`: the one RecordingAudit, the one FakeClock, other small port fakes.
- `machine`, `fleet`: FakeMachine (systemd, nft and Caddy as one model) and one host's
  pass sandbox driven through the engine (`Fleet`).
- `memo_sandbox`, `pass_imports`: whole `fabric reconcile` passes into a sandbox root,
  and what a pass imported.
- `probe_fixtures`, `render`: the recorded probes under tests/fixtures/probe, and
  the example fleet's renders.
- `plan_keys`, `registry_store`, `edge_host`, `wheel`, `e2e`: throwaway plan keys, the
  registry backends' store, the edge host's container, the built wheel, the e2e scenarios' reads.
- `harness/`: the real components (systemd, etcd, PostgreSQL, Caddy, network
  namespaces), each started by the test and stopped by PID.
"""
