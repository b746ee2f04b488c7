"""Tools over the library, which the library never imports: the CLI, inspect and plan, progress, the demo, the launcher."""
