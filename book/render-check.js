// Used only by `just book-render` (book/render-check.sh), which opens each
// chapter with `?render-check`: records script errors and failed resources,
// then, once the page has loaded, writes what it saw into the page as JSON
// for headless Chromium's --dump-dom to read. Readers never trigger it.
(function () {
    if (!location.search.includes("render-check")) return;
    const errors = [];
    window.addEventListener("error", (e) => {
        const t = e.target;
        errors.push(t && t !== window && (t.src || t.href) ? "failed to load " + (t.src || t.href) : String(e.message));
    }, true);
    const consoleError = console.error;
    console.error = (...args) => { errors.push(args.map(String).join(" ")); consoleError(...args); };
    window.addEventListener("load", () => {
        const figures = [...document.querySelectorAll("main img")].map((img) => {
            const r = img.getBoundingClientRect();
            return { src: img.getAttribute("src"), width: Math.round(r.width), height: Math.round(r.height), natural: img.naturalWidth };
        });
        const out = document.createElement("pre");
        out.id = "render-check";
        out.textContent = JSON.stringify({ title: document.title, errors, figures });
        document.body.appendChild(out);
    });
})();
