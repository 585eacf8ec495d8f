"""Names both routes of a pass share: the full pass (engine.pass_records,
core.views.metrics, the wiring) and the memoized pass (engine.memoized_pass),
which must not import the models or templates to learn them. Standard
library only: the import contract "what a memoized pass imports" covers it.
"""

# The pass counters, in the state directory.
PASS_COUNTERS = "pass-counters.json"
# node_exporter's textfile of this host's metrics, under the root.
TEXTFILE_PATH = "var/lib/node_exporter/textfile/fabric.prom"
# The programs the rendered units name, found on PATH (the wiring's
# program_paths); where each is found is part of the pass memo's key.
PROGRAMS = ("socat", "podman", "nft", "systemd-tmpfiles", "systemd-sysusers", "ray")
# This host's own node.toml, under the root: a full pass reads the prefixes
# its units' paths may lie under there, so it is part of the memo's key.
NODE_CONFIG_FILE = "etc/fabric/node.toml"
