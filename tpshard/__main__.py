from tpshard.cli import main

main()
