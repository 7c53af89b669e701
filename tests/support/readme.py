"""The command blocks of README.md, as a test runs them."""

from support import paths


def commands(section: str) -> list[str]:
  """The lines of the first ```bash block after the README heading `section` (`## Title`),
  comment lines left out."""
  readme = (paths.REPO / "README.md").read_text()
  block = readme.split(section, 1)[1].split("```bash", 1)[1]
  return [c.strip() for c in block.split("```", 1)[0].strip().splitlines()
          if c.strip() and not c.strip().startswith("#")]
