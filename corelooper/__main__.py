from corelooper.cli.start import main

main()
