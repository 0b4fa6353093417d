"""The measurements behind every number in the README (`agoq bench NAME`), each writing a JSON result with its command and machine."""
