from corelooper.cli.app import main

main()
