"""`agoq train` from a config: the typed config, the decided `auto` choices, the local launcher (fork
server, run-folder lock, loopback store), and the builders that make a Trainer's components."""
