"""Command-line tools: `segpack <command>` (`python -m segpack <command>`)."""
