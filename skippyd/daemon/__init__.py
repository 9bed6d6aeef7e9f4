"""The stage process: assemble a stage from its config, serve it, drain and stop.

``lifecycle`` runs ``skippyd serve``; ``assembly`` builds tokenizer, runtime and worker;
``split`` adds a split pipeline's link; ``snapshot`` and ``sdnotify`` report status. The
only room that wires the others together: nothing below it imports from here.
"""
