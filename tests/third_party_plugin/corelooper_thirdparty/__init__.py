"""A third-party corelooper plugin package for corelooper's tests."""
