"""The package's logger: the application decides where surgery's messages go."""

from __future__ import annotations

import subprocess
import sys


def test_a_message_goes_where_the_application_sends_it_never_to_the_last_resort_handler():
    script = (
        "import logging, surgery\n"
        "logging.getLogger('surgery').warning('unconfigured')\n"
        "logging.basicConfig(format='%(name)s %(levelname)s %(message)s')\n"
        "logging.getLogger('surgery').warning('configured')\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert [line for line in result.stderr.splitlines() if "configured" in line] == ["surgery WARNING configured"]
