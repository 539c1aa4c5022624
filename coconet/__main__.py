from coconet.cli import main

main()
