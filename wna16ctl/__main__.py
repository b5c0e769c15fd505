from wna16ctl.cli import main

main()
