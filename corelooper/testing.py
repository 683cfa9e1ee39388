"""pytest plugin for plugin authors (entry point ``pytest11``): fixtures are added in issue 4."""
