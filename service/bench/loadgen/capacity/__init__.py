"""`bench capacity`: the search (search), one steady-state probe (probe) and the command (command)."""
