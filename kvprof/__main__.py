from kvprof.cli import main

main()
